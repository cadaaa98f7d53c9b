// graph_call.cpp: one call of a shipped graph (compile.py's ShippedGraph) with no Python per tensor.
//
// compile.py hands over, once per graph, how each output is made: fresh, a fresh
// storage other outputs view, an input, a view of an input or of an earlier
// output, a plain value. A call describes the inputs, makes the outputs, packs
// Msg.RUN as msgpack-python packs compile.py's list and posts it through the
// session as the fast path posts an op. An input other than an rgpu tensor or a
// plain number leaves the call to Python (None), before anything is made or sent.
#include "fast_path.h"
#include "rgpu_device.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/python_variable.h>

namespace rgpu {
namespace {

constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);
constexpr int kMsgRun = RGPU_MSG_RUN;  // [events, graph id, inputs, outs]

// compile.py's spec kinds, in the order of its _cpp_spec()
enum class Make : int { kNew = 0, kBase = 1, kInput = 2, kAliasIn = 3, kAliasOut = 4, kValue = 5 };

struct Output {
  Make make = Make::kValue;
  int from = -1;  // the input (kInput, kAliasIn) or earlier output (kAliasOut) it is or views
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0, nbytes = 0;
  c10::DeviceIndex device = 0;
  py::object value;  // kValue
};

// An input as compile.py's Python path sends it; false when only Python knows how.
bool pack_input(Packer& p, PyObject* a) {
  if (a == Py_None) {
    p.nil();
  } else if (PyBool_Check(a)) {
    p.boolean(a == Py_True);
  } else if (PyLong_CheckExact(a)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
    if (overflow) return false;  // msgpack's unsigned 64-bit range: Python's
    p.integer(v);
  } else if (PyFloat_CheckExact(a)) {
    p.real(PyFloat_AS_DOUBLE(a));
  } else if (THPVariable_Check(a) && THPVariable_Unpack(a).device().type() == c10::DeviceType::PrivateUse1) {
    pack_descriptor(p, THPVariable_Unpack(a));
  } else {
    return false;
  }
  return true;
}

class GraphCall {
 public:
  // specs: per output, (kind, ...) as compile.py's _cpp_spec() writes them
  GraphCall(int64_t gid, const py::list& specs) : gid_(gid) {
    for (auto item : specs) {
      auto t = py::reinterpret_borrow<py::tuple>(item);
      Output o;
      o.make = static_cast<Make>(t[0].cast<int>());
      if (o.make == Make::kValue) {
        o.value = py::reinterpret_borrow<py::object>(t[1]);
      } else if (o.make == Make::kNew || o.make == Make::kBase) {
        geometry(o, t, 1);
        o.device = static_cast<c10::DeviceIndex>(t[4].cast<int>());
        if (o.make == Make::kBase) o.nbytes = t[5].cast<int64_t>(), o.offset = t[6].cast<int64_t>();
      } else {
        o.from = t[1].cast<int>();
        if (o.make != Make::kInput) geometry(o, t, 2), o.offset = t[5].cast<int64_t>();
      }
      outs_.push_back(std::move(o));
    }
  }

  // The graph's outputs, its RUN posted; None (nothing made or sent) when Python must do the call.
  py::object operator()(const py::list& args) const {
    if (!streaming()) return py::none();
    size_t n = args.size();
    Packer p;
    p.out.reserve(64 * (n + outs_.size()));
    p.array(n);
    for (auto a : args)
      if (!pack_input(p, a.ptr())) return py::none();
    for (const auto& o : outs_)
      if ((o.make == Make::kInput || o.make == Make::kAliasIn) && static_cast<size_t>(o.from) >= n) return py::none();
    std::vector<at::Tensor> made(outs_.size());
    py::list results(outs_.size());
    p.array(outs_.size());
    for (size_t k = 0; k < outs_.size(); ++k) {
      const auto& o = outs_[k];
      switch (o.make) {
        case Make::kNew:
        case Make::kBase: {
          c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, o.device));
          made[k] = o.make == Make::kNew
                        ? at::Tensor(at::detail::empty_strided_generic(o.sizes, o.strides, allocator(), kKeys, o.dtype))
                        : alias_of(at::detail::empty_generic({o.nbytes}, allocator(), kKeys, at::kByte, std::nullopt),
                                   o.dtype, o.sizes, o.strides, o.offset);
          pack_descriptor(p, made[k]);
          results[k] = py::cast(made[k]);
          continue;
        }
        case Make::kInput:
          results[k] = args[o.from];
          break;
        case Make::kAliasIn:
          results[k] = py::cast(alias_of(THPVariable_Unpack(args[o.from].ptr()), o.dtype, o.sizes, o.strides, o.offset));
          break;
        case Make::kAliasOut:
          TORCH_CHECK(made[o.from].defined(), "rgpu: a graph output views output ", o.from, ", which is not fresh");
          results[k] = py::cast(alias_of(made[o.from], o.dtype, o.sizes, o.strides, o.offset));
          break;
        case Make::kValue:
          results[k] = o.value;
          break;
      }
      p.nil();
    }
    post_message(kMsgRun, 5, gid_, p.out);
    return results;
  }

 private:
  static void geometry(Output& o, const py::tuple& t, size_t at) {
    o.dtype = static_cast<at::ScalarType>(t[at].cast<int>());
    o.sizes = t[at + 1].cast<std::vector<int64_t>>();
    o.strides = t[at + 2].cast<std::vector<int64_t>>();
  }

  int64_t gid_;
  std::vector<Output> outs_;
};

}  // namespace

void bind_graph_call(py::module_& m) {
  py::class_<GraphCall>(m, "GraphCall", "a shipped graph's calls, made and posted in C++ (graph_call.cpp)")
      .def(py::init<int64_t, const py::list&>())
      .def("__call__", &GraphCall::operator());
}

}  // namespace rgpu
