// fast_path.cpp: the boxed fallback for PrivateUse1 that streams an op whose plan is known without Python.
//
// The Python fallback (fallback.py) stays the authority. The first call of each
// op signature goes to it: PyTorch's errors come out at the user's line, the
// meta kernel sizes the outputs, the op is posted; it hands back a plan C++ can
// replay. A later call with the same signature (tensor geometry and dtypes,
// scalar types, scalar values where encode.py keys them) builds its outputs
// here, packs the op's message as encode.py would, and posts it through the
// session (under its lock, with the allocator's events). Anything unusual
// (CPU tensors, math bits, generators, devices, layouts) goes to Python.
// Small copies (an upload, a download, ``.item()``) are done here too when there is nothing to convert
// (fast_copies.cpp).
#include "fast_path.h"
#include "rgpu_device.h"

#include <ATen/EmptyTensor.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <unordered_map>

namespace rgpu {
namespace {

constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);
constexpr int kMsgOp = RGPU_MSG_OP;
constexpr int kMsgDownload = RGPU_MSG_DOWNLOAD;
constexpr size_t kMaxPlans = 50000;  // why a bound: scalar values are part of some signatures

// kInt: an int the op returns (attention's max_q); kUndefined: a Tensor return it leaves undefined
enum class Leaf : int { kNew = 0, kArg = 1, kAlias = 2, kNone = 3, kInt = 4, kUndefined = 5 };

struct Out {
  Leaf kind = Leaf::kNone;
  int arg = -1;  // schema position of the input it is (kArg) or views (kAlias)
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  int64_t value = 0;  // kInt's
};

struct Plan {
  std::vector<Out> outs;     // every leaf of the result, in order (the wire's `outs` has one entry each)
  std::vector<int> returns;  // per schema return: -1 for one leaf, else the length of its list of leaves
  std::vector<std::pair<int, std::vector<int64_t>>> resize;  // empty out= tensors to size first
  bool post = true;          // false: the op only makes views, nothing to tell the server
};

struct OpRecord {
  Arguments args;
  bool never = false;  // the Python side said this op does not stream (call, local)
  bool copy = false;   // aten::_copy_from: small uploads and downloads are done here (fast_copies.cpp)
  bool item = false;   // aten::_local_scalar_dense (.item()): read here (fast_copies.cpp)
  std::vector<int> index;  // each server's op index for it (sent with DEFINE by its first post there), 0: none yet
  std::unordered_map<std::string, Plan> plans;
};

// Every field below is touched with the GIL held: the fallback takes it first.
PyObject* g_miss = nullptr;  // fallback.from_cpp(op, args, kwargs, learn, device) -> (result, learned)
// The session's lock (its acquire and release) and each server's post_packed: the
// message is finished and posted under that lock, as Session.post_op does in Python.
PyObject* g_acquire = nullptr;
PyObject* g_release = nullptr;
struct Target {               // one server of the session (servers.py's Server)
  int64_t first = 0;          // its first device: rgpu:first.. are its
  PyObject* send = nullptr;   // its connection's post_packed (several servers: a failure named, Servers.sender)
  PyObject* events = nullptr; // several servers: Servers.events_for(it), the events due there; one: null (all of them)
  PyObject* call = nullptr;    // one server: its connection's call (several: downloads stay Python's, which names a failure)
  uint64_t posts = 0;         // messages C++ posted to it (fast_path_stats)
};
std::vector<Target> g_targets;  // in device order; empty: no session streams
bool g_enabled = false;
size_t g_plan_count = 0;
std::unordered_map<const c10::FunctionSchema*, OpRecord> g_records;
std::atomic<uint64_t> g_hits{0}, g_misses{0}, g_passes{0}, g_uploads{0}, g_downloads{0}, g_items{0};

// The server holding rgpu:device (servers.Servers.of): the last whose first device is at most it.
size_t target_of(int device) {
  size_t k = g_targets.empty() ? 0 : g_targets.size() - 1;
  while (k > 0 && device < g_targets[k].first) --k;
  return k;
}

OpRecord& record_for(const c10::FunctionSchema& schema) {
  auto it = g_records.find(&schema);
  if (it != g_records.end()) return it->second;
  OpRecord& r = g_records[&schema];
  r.args = arguments_of(schema);
  r.index.assign(std::max<size_t>(g_targets.size(), 1), 0);
  r.copy = schema.name() == "aten::_copy_from" && schema.overload_name().empty();
  r.item = schema.name() == "aten::_local_scalar_dense" && schema.overload_name().empty();
  return r;
}

Out out_from(py::handle leaf) {
  auto t = py::reinterpret_borrow<py::tuple>(leaf);
  Out o;
  o.kind = static_cast<Leaf>(t[0].cast<int>());
  if (o.kind == Leaf::kArg || o.kind == Leaf::kAlias) o.arg = t[1].cast<int>();
  if (o.kind == Leaf::kInt) o.value = t[1].cast<int64_t>();
  if (o.kind == Leaf::kNew || o.kind == Leaf::kAlias) {
    size_t at = o.kind == Leaf::kNew ? 1 : 2;
    o.dtype = static_cast<at::ScalarType>(t[at].cast<int>());
    o.sizes = t[at + 1].cast<std::vector<int64_t>>();
    o.strides = t[at + 2].cast<std::vector<int64_t>>();
    if (o.kind == Leaf::kAlias) o.offset = t[at + 3].cast<int64_t>();
  }
  return o;
}

// learned: (op index, post, returns, resize); each return a leaf tuple or a list of them (meta.express).
// The index is that of the server of rgpu:device, where Python posted the call.
void learn(const c10::FunctionSchema& schema, const std::string& sig, py::handle learned, int device) {
  auto it = g_records.find(&schema);  // found again: the Python call may have started a new session
  if (it == g_records.end()) return;
  OpRecord& r = it->second;
  if (learned.ptr() == Py_False) {
    r.never = true;
    return;
  }
  if (learned.is_none()) return;
  auto t = py::reinterpret_borrow<py::tuple>(learned);
  Plan plan;
  size_t k = target_of(device);
  if (t[0].cast<int>() > 0 && k < r.index.size()) r.index[k] = t[0].cast<int>();  // 0: a plan that posts nothing
  plan.post = t[1].cast<bool>();
  for (auto ret : py::reinterpret_borrow<py::list>(t[2])) {
    if (py::isinstance<py::list>(ret)) {
      auto leaves = py::reinterpret_borrow<py::list>(ret);
      plan.returns.push_back(static_cast<int>(leaves.size()));
      for (auto leaf : leaves) plan.outs.push_back(out_from(leaf));
    } else {
      plan.returns.push_back(-1);
      plan.outs.push_back(out_from(ret));
    }
  }
  for (auto item : py::reinterpret_borrow<py::list>(t[3])) {
    auto pair = py::reinterpret_borrow<py::tuple>(item);
    plan.resize.emplace_back(pair[0].cast<int>(), pair[1].cast<std::vector<int64_t>>());
  }
  if (g_plan_count >= kMaxPlans) {
    for (auto& entry : g_records) entry.second.plans.clear();
    g_plan_count = 0;
  }
  if (r.plans.emplace(sig, std::move(plan)).second) ++g_plan_count;
}

// `device`: the call's device as the signature found it (-1: none, the current device's), or -1 without `sig`.
void miss(const c10::OperatorHandle& op, torch::jit::Stack* stack, const OpRecord& r, const std::string* sig,
          int device = -1) {
  const auto& schema = op.schema();
  auto arguments = torch::jit::pop(*stack, schema.arguments().size());
  auto [args, kwargs] = to_python(schema, r.args, arguments);
  py::handle fn = torch::detail::getTorchApiFunction(op);
  if (device < 0) device = current_device();  // as Python's fallback picks the server (the same thread)
  auto got = py::reinterpret_borrow<py::object>(g_miss)(fn, args, kwargs, sig != nullptr, device);
  auto pair = py::reinterpret_borrow<py::tuple>(got);
  if (sig != nullptr) learn(schema, *sig, pair[1], device);
  push_result(schema, stack, pair[0]);
}

// ---- a hit ----

// The session's lock, let go however the post ends. Its own references: acquire() may let the
// GIL go, and a new session meanwhile replaces the globals.
struct Held {
  py::object release = py::reinterpret_borrow<py::object>(g_release);
  Held() { py::reinterpret_borrow<py::object>(g_acquire)(); }
  ~Held() { call_keeping_error(release); }  // a failed post's error survives the release
};

}  // namespace

void call_keeping_error(py::handle fn) {
  PyObject *type, *value, *trace;
  PyErr_Fetch(&type, &value, &trace);
  Py_XDECREF(PyObject_CallNoArgs(fn.ptr()));
  PyErr_Restore(type, value, trace);
}

bool streaming() { return g_enabled && !g_targets.empty(); }

namespace {

// [kind, events, key (if any), ...body] to server `k`: events drained under the lock, so every message
// carries the events recorded before it in the order the messages go out; `buffer`, if any, goes with it.
void post(int kind, size_t fields, const int64_t* key, const std::string& body, size_t k,
          py::handle buffer = {}) {
  if (k >= g_targets.size()) throw std::runtime_error("rgpu: the session's servers changed during the call");
  // The session's, even if a new one starts meanwhile (acquire may let the GIL go)
  auto send = py::reinterpret_borrow<py::object>(g_targets[k].send);
  py::object split = g_targets[k].events ? py::reinterpret_borrow<py::object>(g_targets[k].events) : py::object();
  Held held;
  if (k < g_targets.size()) ++g_targets[k].posts;
  Packer head;
  head.array(fields);
  head.integer(kind);
  // several servers: the events due at this one, as Servers.events_for splits them
  auto events = split ? split().cast<std::vector<int64_t>>() : drain_events();
  head.array(events.size());
  for (auto e : events) head.integer(e);
  if (key != nullptr) head.integer(*key);
  PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(head.out.size() + body.size()));
  if (raw == nullptr) throw py::error_already_set();
  auto message = py::reinterpret_steal<py::bytes>(raw);
  std::memcpy(PyBytes_AS_STRING(raw), head.out.data(), head.out.size());
  std::memcpy(PyBytes_AS_STRING(raw) + head.out.size(), body.data(), body.size());
  if (buffer) send(message, py::make_tuple(buffer));
  else send(message);
}

}  // namespace

void post_message(int kind, size_t fields, int64_t key, const std::string& body, size_t server) {
  post(kind, fields, &key, body, server);
}

void post_buffer(int kind, const std::string& body, int device, py::handle buffer) {
  post(kind, 3, nullptr, body, target_of(device), buffer);
}

py::object call_download(const at::Tensor& t, py::handle into) {
  if (g_targets.size() != 1 || g_targets[0].call == nullptr) return py::none();
  auto call = py::reinterpret_borrow<py::object>(g_targets[0].call);  // the session's, as in post()
  auto release = py::reinterpret_borrow<py::object>(g_release);
  py::reinterpret_borrow<py::object>(g_acquire)();
  // the lock is let go once the request is written (the connection calls `sent`), or by the guard however the
  // call ends; the flag is shared, not a reference to this frame, so a `sent` kept past the call does nothing
  auto held = std::make_shared<bool>(true);
  py::cpp_function sent([held, release]() {
    if (*held) {
      *held = false;
      call_keeping_error(release);
    }
  });
  struct LetGo {
    py::handle sent;
    ~LetGo() { call_keeping_error(sent); }
  } guard{sent};
  auto events = drain_events();
  py::list drained(events.size());
  for (size_t i = 0; i < events.size(); ++i) drained[i] = py::int_(events[i]);
  return call(py::make_tuple(kMsgDownload, drained, describe(t)), py::tuple(), py::make_tuple(into), py::none(), sent);
}

namespace {

// Returns false (nothing done) when an input the plan names is not a tensor this time, or when the
// op was never posted to its device's server (its index there comes with Python's post).
bool replay(const c10::FunctionSchema& schema, torch::jit::Stack* stack, const OpRecord& r, const Plan& plan,
            int device) {
  if (device < 0) device = current_device();
  size_t server = target_of(device);
  if (plan.post && (server >= r.index.size() || r.index[server] == 0)) return false;
  size_t n = schema.arguments().size();
  auto args = torch::jit::last(*stack, n);
  for (const auto& o : plan.outs)
    if (o.arg >= 0 && !args[o.arg].isTensor()) return false;
  for (const auto& [pos, sizes] : plan.resize)
    if (!args[pos].isTensor()) return false;
  for (const auto& [pos, sizes] : plan.resize) args[pos].toTensor().resize_(sizes);  // as fallback.py does
  std::vector<c10::IValue> results;
  results.reserve(plan.outs.size());
  Packer p;
  p.out.reserve(256);
  if (plan.post) pack_arguments(p, schema, r.args, args);
  bool fresh = false;
  for (const auto& o : plan.outs) fresh |= o.kind == Leaf::kNew;
  if (fresh) p.array(plan.outs.size());
  else p.nil();
  for (const auto& o : plan.outs) {
    if (o.kind == Leaf::kNew) {
      c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)));
      at::Tensor t = at::detail::empty_strided_generic(o.sizes, o.strides, allocator(), kKeys, o.dtype);
      pack_descriptor(p, t);
      results.emplace_back(std::move(t));
      continue;
    }
    if (fresh) p.nil();
    if (o.kind == Leaf::kArg) {
      results.push_back(args[o.arg]);
    } else if (o.kind == Leaf::kAlias) {
      results.emplace_back(alias_of(args[o.arg].toTensor(), o.dtype, o.sizes, o.strides, o.offset));
    } else if (o.kind == Leaf::kInt) {
      results.emplace_back(o.value);
    } else if (o.kind == Leaf::kUndefined) {
      results.emplace_back(at::Tensor());
    } else {
      results.emplace_back();
    }
  }
  // The stack first, the post last: the post may let the GIL go, and a new session then clears the plans.
  // The arguments live until after the post: were the stack's the last references to an input, its
  // free would otherwise ride in (and be applied before) the very message that names it.
  bool posts = plan.post;
  int index = plan.post ? r.index[server] : 0;
  auto inputs = torch::jit::pop(*stack, n);
  size_t next = 0;
  for (int count : plan.returns) {
    if (count < 0) {
      stack->push_back(std::move(results[next++]));
      continue;
    }
    c10::List<at::Tensor> list;
    list.reserve(count);
    for (int i = 0; i < count; ++i) list.push_back(results[next++].toTensor());
    stack->emplace_back(std::move(list));
  }
  if (posts) post_message(kMsgOp, 6, index, p.out, server);  // [Msg.OP, events, op index, args, kwargs, outs]
  return true;
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  py::gil_scoped_acquire gil;
  const auto& schema = op.schema();
  OpRecord& r = record_for(schema);
  if (r.copy && streaming()) {
    Copied done = copy_fast(stack);
    if (done != Copied::kNo) {
      ++(done == Copied::kUpload ? g_uploads : g_downloads);
      return;
    }
  }
  if (r.item && streaming() && item_fast(stack)) {
    ++g_items;
    return;
  }
  if (!streaming() || r.never) {
    ++g_passes;
    return miss(op, stack, r, nullptr);
  }
  auto args = torch::jit::last(*stack, schema.arguments().size());
  std::string sig;
  sig.reserve(128);
  int device = -1;
  if (!signature(sig, r.args, args, device)) {
    ++g_passes;
    return miss(op, stack, r, nullptr);
  }
  auto it = r.plans.find(sig);
  if (it != r.plans.end() && replay(schema, stack, r, it->second, device)) {
    ++g_hits;
    return;
  }
  ++g_misses;
  miss(op, stack, r, &sig, device);
}

torch::Library* g_fallback_lib = nullptr;  // never freed: the dispatcher may outlive static destructors
torch::Library* g_claim_lib = nullptr;

}  // namespace

namespace {

void fast_install(py::object miss_fn) {
  if (g_miss == nullptr) g_miss = miss_fn.release().ptr();
  if (g_fallback_lib == nullptr) {
    g_fallback_lib = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    g_fallback_lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

void fast_claim(const std::vector<std::string>& names) {
  if (g_claim_lib == nullptr)
    g_claim_lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const auto& name : names) g_claim_lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// servers: (first device, post_packed, events or None, call or None) per server, in device order.
void fast_session(py::object lock, const py::list& servers, bool enabled, size_t copy_max) {
  for (PyObject** slot : {&g_acquire, &g_release}) Py_CLEAR(*slot);
  for (auto& t : g_targets) {
    Py_CLEAR(t.send);
    Py_CLEAR(t.events);
    Py_CLEAR(t.call);
  }
  g_targets.clear();
  if (enabled) {
    g_acquire = py::object(lock.attr("acquire")).release().ptr();
    g_release = py::object(lock.attr("release")).release().ptr();
    for (auto item : servers) {
      auto t = py::reinterpret_borrow<py::tuple>(item);
      Target target;
      target.first = t[0].cast<int64_t>();
      target.send = py::object(t[1]).release().ptr();
      if (!t[2].is_none()) target.events = py::object(t[2]).release().ptr();
      if (!t[3].is_none()) target.call = py::object(t[3]).release().ptr();
      g_targets.push_back(target);
    }
  }
  g_enabled = enabled;
  set_copy_bytes(copy_max);
  g_records.clear();
  g_plan_count = 0;
}

py::dict fast_stats(bool reset) {
  py::dict d;
  d["hits"] = g_hits.load();
  d["misses"] = g_misses.load();
  d["passes"] = g_passes.load();
  d["plans"] = g_plan_count;
  d["uploads"] = g_uploads.load();
  d["downloads"] = g_downloads.load();
  d["items"] = g_items.load();
  py::list posts;  // per server of the session, in device order
  for (auto& t : g_targets) {
    posts.append(t.posts);
    if (reset) t.posts = 0;
  }
  d["posts"] = posts;
  if (reset) g_hits = g_misses = g_passes = g_uploads = g_downloads = g_items = 0;
  return d;
}

}  // namespace

void bind_fast_path(py::module_& m) {
  m.def("fast_install", &fast_install, "route PrivateUse1's fallback through the fast path (once)");
  m.def("fast_claim", &fast_claim, "make the fast path the PrivateUse1 kernel of these aten ops");
  m.def("fast_session", &fast_session, "a new session: its lock, its servers ((first device, post_packed, events or "
        "None, call or None) each), whether C++ streams, the biggest copy C++ does", py::arg("lock"),
        py::arg("servers"), py::arg("enabled"), py::arg("copy_max") = 0);
  m.def("fast_path_stats", &fast_stats, py::arg("reset") = false);
}

}  // namespace rgpu
