"""The nvcc test programs (tests/cuda_programs) on a GPU host, natively and through rgpu; JSON rows.

    python3 gpu/cuda_programs_check.py REPO [shared|static] [TRACE_DIR]   (check_cuda_runtime.sh, check_cuda_static.sh)

Each program is built for sm_90 with ``-cudart shared`` (rgpu's translated libcudart.so.13 takes its calls)
or ``-cudart static`` (nvcc's default: the runtime inside the program asks rgpu's driver for its export
tables), run natively and through ``rgpu intercept run`` (RGPU_SERVER, RGPU_TOKEN from the environment),
its output compared line by line (times removed) and checked with numpy. Exit 1 when one differs.
With TRACE_DIR, saxpy runs through rgpu once more with the driver-call trace (gpu/cuda_call_trace: each call
Python answers, each message to the server and its reply, each launch record) on stderr, kept as
TRACE_DIR/saxpy-RUNTIME.trace: what a failing launch sent.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

repo, runtime = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "shared")
trace_dir = sys.argv[3] if len(sys.argv) > 3 else None
sys.path.insert(0, os.path.join(repo, "tests"))
from cuda_programs import HERE, PROGRAMS, check, nvcc  # noqa: E402  (the tests' programs and their checks)

TIMING = re.compile(r"^elapsed\S* .*$", re.M)
NATIVE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}


def keep_trace(exe: str, path: str) -> None:
    """The program through rgpu with the driver-call trace on; its stderr (and exit status) into ``path``."""
    paths = [os.path.join(repo, "gpu", "cuda_call_trace"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    with open(path, "w") as err:
        try:
            done = subprocess.run([sys.executable, "-m", "rgpu", "intercept", "run", "--", exe], stdout=subprocess.DEVNULL,
                                  stderr=err, timeout=120, env=env)
            err.write(f"exit status {done.returncode}\n")
        except subprocess.TimeoutExpired:
            err.write("timed out after 120 s\n")


def run_one(name: str, folder: str) -> dict:
    row = {"program": name, "runtime": runtime, "arch": "sm_90"}
    try:
        exe = os.path.join(folder, f"{name}-{runtime}")
        subprocess.run([nvcc(), "-cudart", runtime, "-O2", "-gencode", "arch=compute_90,code=sm_90", f"-I{HERE}",
                        "-o", exe, str(HERE / f"{name}.cu")], check=True, capture_output=True, text=True)
        row["links_libcudart"] = "libcudart" in subprocess.run(["ldd", exe], capture_output=True, text=True).stdout
        native = subprocess.run([exe], capture_output=True, text=True, timeout=60, env=NATIVE_ENV)
        ours = subprocess.run([sys.executable, "-m", "rgpu", "intercept", "run", "--", exe],
                              capture_output=True, text=True, timeout=120)
        if trace_dir and name == "saxpy":
            keep_trace(exe, os.path.join(trace_dir, f"{name}-{runtime}.trace"))
        row.update(native_rc=native.returncode, rgpu_rc=ours.returncode, rgpu_err=ours.stderr[-1500:],
                   same=TIMING.sub("", native.stdout) == TIMING.sub("", ours.stdout))
        for side, out in (("native", native.stdout), ("rgpu", ours.stdout)):
            try:
                check(name, out)
                row[side + "_numpy"] = True
            except Exception as exc:
                row[side + "_numpy"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if not row["same"]:
            row["native_out"], row["rgpu_out"] = native.stdout[:800], ours.stdout[:800]
    except subprocess.CalledProcessError as exc:
        row["error"] = f"nvcc: {exc.stderr[-800:]}"
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:800]}"
    row["ok"] = row.get("same") is True and row.get("native_rc") == 0 and row.get("rgpu_rc") == 0
    return row


if __name__ == "__main__":
    folder = tempfile.mkdtemp(prefix=f"rgpu-programs-{runtime}-")
    rows = [run_one(name, folder) for name in PROGRAMS]
    print(json.dumps(rows, indent=1))
    sys.exit(0 if all(r["ok"] for r in rows) else 1)
