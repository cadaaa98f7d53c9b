"""``rgpu doctor``: every check in order, a fix for each failure, exit 0 only when everything works."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import clean_env, wait_until

from rgpu import doctor

ORDER = ["server", "auth", "versions", "transport", "speed", "devices", "tls"]


def by_name(results):
    assert [c.name for c in results] == ORDER
    return {c.name: c for c in results}


def test_a_healthy_server_passes_every_check_and_json_says_so(rgpu_server):
    done = subprocess.run([sys.executable, "-m", "rgpu", "doctor", "--json", "--server", rgpu_server.address],
                          capture_output=True, text=True, timeout=300, env=clean_env(RGPU_TOKEN=rgpu_server.token))
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["ok"], done.stdout + done.stderr
    checks = {c["name"]: c for c in report["checks"]}
    assert [c["name"] for c in report["checks"]] == ORDER
    assert all(c["status"] == "ok" for c in checks.values()), checks
    assert checks["versions"]["data"]["server"]["rgpu"] == checks["versions"]["data"]["client"]["rgpu"]
    assert checks["speed"]["data"]["rtt_us"] > 0 and checks["speed"]["data"]["upload_GBps"] > 0
    assert checks["transport"]["data"]["chosen"] in ("tcp", "shm", "ucx")
    assert checks["devices"]["data"]["devices"] and checks["devices"]["data"]["op_path"] == "C++"
    assert "loopback" in checks["tls"]["detail"] or "shm" in checks["tls"]["detail"]


@pytest.mark.parametrize("shm_c", [True, False])
def test_on_shm_the_transport_check_says_whether_its_c_path_runs(rgpu_server, shm_c):
    from rgpu.transport import shm, shm_fast

    if shm.available() or (shm_c and shm_fast.load() is None):
        pytest.skip(str(shm.available() or shm_fast.why_not()))
    checks = by_name(doctor.run_checks(rgpu_server.settings(transport="shm", shm_c=shm_c)))
    assert checks["transport"].data["shm_c"] is shm_c
    assert ("C path built" if shm_c else "Python path (RGPU_NATIVE=off)") in checks["transport"].detail


def test_no_server_fails_the_first_check_skips_the_rest_and_says_how_to_start_one():
    results = by_name(doctor.run_checks(doctor.config.settings(environ={}, server="127.0.0.1:1", token="t")))
    assert results["server"].status == "fail" and "rgpu serve" in results["server"].fix
    assert all(results[n].status == "skip" for n in ORDER[1:])


def test_a_wrong_token_fails_authentication_with_the_fix_and_exit_status_1(rgpu_server):
    results = by_name(doctor.run_checks(rgpu_server.settings().with_(token="not-the-token")))
    assert results["server"].status == "ok"
    assert results["auth"].status == "fail" and "token" in results["auth"].fix
    assert all(results[n].status == "skip" for n in ORDER[2:])
    done = subprocess.run([sys.executable, "-m", "rgpu", "doctor", "--server", rgpu_server.address],
                          capture_output=True, text=True, timeout=120, env=clean_env(RGPU_TOKEN="wrong"))
    assert done.returncode == 1
    assert re.search(r"FAIL\s+auth", done.stdout) and "fix:" in done.stdout


def test_tls_state_is_reported_pinned_and_a_plain_client_of_a_tls_server_is_told_to_pin(start_server):
    server = start_server("--tls")
    wait_until(lambda: "RGPU_TLS_FINGERPRINT=" in server.stdout, what="the fingerprint line")
    fp = re.search(r"RGPU_TLS_FINGERPRINT=(\S+)", server.stdout).group(1)
    results = by_name(doctor.run_checks(server.settings(tls_fingerprint=fp, transport="tcp")))  # shm needs no TLS
    assert results["tls"].status == "ok" and "pinned" in results["tls"].detail and fp in results["tls"].detail
    plain = by_name(doctor.run_checks(server.settings()))
    assert plain["auth"].status == "fail" and "requires TLS" in plain["auth"].detail


def test_plain_tcp_to_another_host_is_a_warning_not_a_failure():
    class Conn:
        class transport:
            name, tls = "tcp", False

    ctx = doctor.Context(doctor.config.settings(environ={}, server="10.1.2.3:9713"))
    ctx.conn = Conn()
    check = doctor.check_tls(ctx)
    assert check.status == "warn" and "--tls" in check.fix


@pytest.mark.parametrize("failed", [True, False])
def test_a_server_whose_cpp_op_path_failed_to_build_is_a_warning_with_the_fix(monkeypatch, failed):
    from rgpu import config
    from rgpu.transport import client

    class Welcomed:   # the ops route's welcome, as a server whose build failed (or is under way) sends it
        welcome = {"info": {"device": "cpu", "names": ["cpu"],
                            "op_path": "Python (the C++ op path cannot be built here: no g++)" if failed else
                            "Python (the C++ op path is being built in the background; later sessions use it)",
                            "op_path_failed": failed}}

        def close(self):
            pass

    monkeypatch.setattr(client, "connect", lambda route, settings=None: Welcomed())
    check = doctor.check_devices(doctor.Context(config.settings(environ={}, server="127.0.0.1:1")))
    assert check.status == ("warn" if failed else "ok")
    assert "ops run through Python" in check.detail
    assert ("C++ compiler" in (check.fix or "")) == failed


def test_doctor_names_where_the_token_came_from_and_never_prints_it(rgpu_server):
    for flags in ([], ["--json"]):
        done = subprocess.run([sys.executable, "-m", "rgpu", "doctor", "--server", rgpu_server.address, *flags],
                              capture_output=True, text=True, timeout=600,
                              env=clean_env(RGPU_TOKEN=rgpu_server.token))
        assert done.returncode == 0, done.stdout + done.stderr
        assert rgpu_server.token not in done.stdout + done.stderr
        assert "set, from RGPU_TOKEN (not shown)" in done.stdout


def test_the_speed_check_gives_a_tensors_to_rgpu_and_cpu_beside_the_transports_raw_figure(rgpu_server):
    checks = by_name(doctor.run_checks(rgpu_server.settings()))
    data = checks["speed"].data
    assert data["upload_GBps"] > 0 and data["to_rgpu_GBps"] > 0 and data["cpu_GBps"] > 0, checks["speed"].detail
    assert 'a 64 MiB tensor as your code moves it: .to("rgpu")' in checks["speed"].detail
    assert "the transport raw" in checks["speed"].detail


def test_the_text_report_prints_each_check_as_it_ends(rgpu_server):
    seen = []
    results = doctor.run_checks(doctor.config.settings(environ={}, server="127.0.0.1:1", token="t"), seen.append)
    assert seen == results and [c.name for c in seen] == ORDER


# ---- several servers (RGPU_SERVER=a,b) ----------------------------------------------------------


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    """Two CPU servers of two devices each: the session's rgpu:0..1 and rgpu:2..3."""
    from conftest import RunningServer

    started = [RunningServer(tmp_path_factory.mktemp(f"doctor{i}"), ("--device", "cpu", "--devices", "2"))
               for i in range(2)]
    yield started
    for s in started:
        s.stop()


def test_each_of_several_servers_is_checked_and_its_devices_numbered_as_the_session_numbers_them(two_servers):
    from conftest import TOKEN

    from rgpu import doctor_servers

    wheres = [s.address for s in two_servers]
    seen = []
    settings = doctor.config.settings(environ={}, server=",".join(wheres), token=TOKEN, transport="tcp",
                                      tcp_streams=1)
    reports = doctor_servers.check_servers(settings, lambda where, c: seen.append((where, c.name)))
    assert [r.where for r in reports] == wheres
    assert seen == [(w, name) for w in wheres for name in ORDER]   # in turn, each check naming its server
    for r in reports:
        checks = by_name(r.checks)
        assert all(c.status == "ok" for c in checks.values()), [(c.name, c.detail) for c in r.checks]
        assert checks["server"].data["address"] == r.where
    assert [(r.first, r.count) for r in reports] == [(0, 2), (2, 2)]   # two --devices 2 servers, in their order
    second = by_name(reports[1].checks)["devices"].detail
    assert "rgpu:2 " in second and "rgpu:3 " in second and "rgpu:0 " not in second, second
    assert doctor_servers.summary(reports) == (f"2 servers, 4 devices rgpu:0..3: rgpu:0..1 on {wheres[0]}, "
                                               f"rgpu:2..3 on {wheres[1]}")


def test_a_dead_server_among_several_is_named_and_the_others_are_still_checked(two_servers):
    from conftest import TOKEN

    dead = "127.0.0.1:1"
    wheres = [two_servers[0].address, dead, two_servers[1].address]
    done = subprocess.run([sys.executable, "-m", "rgpu", "doctor", "--server", ",".join(wheres)],
                          capture_output=True, text=True, timeout=600,
                          env=clean_env(RGPU_TOKEN=TOKEN, RGPU_TRANSPORT="tcp"))
    assert done.returncode == 1, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if re.match(r"  (ok|WARN|FAIL|skip)\s", line)]
    assert len(rows) == 3 * len(ORDER), done.stdout
    for i, where in enumerate(wheres):   # every line of a server's checks names it
        assert all(f" {where} " in row for row in rows[i * len(ORDER):(i + 1) * len(ORDER)]), done.stdout
    assert re.search(rf"FAIL\s+{re.escape(dead)}\s+server", done.stdout)
    assert re.search(rf"ok\s+{re.escape(wheres[2])}\s+devices\s+.*its device 0", done.stdout)  # after the dead one
    assert sum(bool(re.match(r"  ok\s", row)) for row in rows) == 2 * len(ORDER)   # the live ones passed
    assert f"1 of 3 servers failed: {dead} (server: " in done.stderr, done.stderr
    assert "summary: 1 of 3 servers failed" in done.stdout


def test_json_of_several_servers_gives_each_ones_checks_and_the_sessions_device_count(two_servers):
    from conftest import TOKEN

    wheres = [s.address for s in two_servers]
    done = subprocess.run([sys.executable, "-m", "rgpu", "doctor", "--json", "--server", ",".join(wheres)],
                          capture_output=True, text=True, timeout=600,
                          env=clean_env(RGPU_TOKEN=TOKEN, RGPU_TRANSPORT="tcp"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["devices"] == 4   # two --devices 2 servers
    assert [(s["server"], s["ok"], s["first"], s["count"]) for s in report["servers"]] == [
        (wheres[0], True, 0, 2), (wheres[1], True, 2, 2)]
    assert all([c["name"] for c in s["checks"]] == ORDER for s in report["servers"])
    assert report["summary"].startswith("2 servers, 4 devices rgpu:0..3")
