// The ops route's common case in C++: one streamed op (Msg.OP) decoded, run and bound without Python.
//
// Why: in an eager training step the server, not the GPU, set the pace, and most of its time per op
// was the executor's Python around the aten call (decoding the wire's values, the view cache, the
// op's own argument parsing, binding the outputs). Here the wire's values (already unpacked by
// msgpack) become a boxed stack by the op's schema, views and fresh outputs come straight out of the
// session's handle table (handle_table.h, a C++ object the Python side uses too), and the op runs through
// the dispatcher. GPU host, an eager
// nanoGPT step's messages replayed (tools/diag/diag_replay.py): docs/perf/fast_path-history.md, run9.
//
// The Python executor stays the reference and the rest: run() answers false, having changed
// nothing the Python path would not do the same way, for anything it does not take (a tagged value
// other than a tensor, dtype, device, layout or memory format; a complex number where the schema
// says Tensor; an unknown keyword), and an op with an argument type it does not know, a substitute without
// a recipe in fast_substitutes.h, a CPU adaptation or a generator on the CPU is never defined here. Whatever is unusual after the op
// ran (a written view whose layout changed, an output in another layout than the client's, one that
// aliases an input) goes back to the executor's own Python for that part.
#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/python_arg_parser.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "rgpu_protocol.h"  // rgpu/protocol: message kinds, events, value tags (generated)
#include "fast_schema.h"
#include "fast_substitutes.h"
#include "handle_table.h"
#include "fast_copies.h"

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using namespace rgpu_server;

// A wire value {"tag": x} with one key: x, else nullptr.
inline PyObject* tagged(PyObject* v, PyObject* tag) {
  if (!PyDict_CheckExact(v) || PyDict_GET_SIZE(v) != 1) return nullptr;
  return PyDict_GetItem(v, tag);
}

class FastOps {
 public:
  // table: the session's handle table (one for both paths); written(name, kwarg_only, tensor, wire) and
  // bind(results, outs, input_ptrs): the executor's own Python for what is unusual after an op ran.
  FastOps(std::shared_ptr<HandleTable> table, bool on_cuda, py::object written, py::object bind)
      : table_(std::move(table)), on_written_(written), on_bind_(bind), on_cuda_(on_cuda) {
    for (const char* k : {RGPU_TAG_TENSOR, RGPU_TAG_DTYPE, RGPU_TAG_DEVICE, RGPU_TAG_LAYOUT, RGPU_TAG_MEMORY_FORMAT})
      tags_.push_back(steal(PyUnicode_InternFromString(k)));
  }

  // Whether op #index (aten::name.overload; "default" is the unnamed overload) runs here; checked:
  // the executor's (position, name, keyword-only) of written arguments it checks after the op;
  // substituted: the executor runs a substitute for it (only one with a recipe here runs here).
  bool define(int64_t index, const std::string& name, const std::string& overload, py::list checked,
              bool substituted) {
    ops_.erase(index);
    auto h = c10::Dispatcher::singleton().findSchema({"aten::" + name, overload == "default" ? "" : overload});
    if (!h) return false;
    auto op = std::make_unique<Op>(*h);
    if (substituted && (op->recipe = recipe_for(name + "." + overload, on_cuda_)) == nullptr) return false;
    // torch.ops turns a number in a Tensor argument into a wrapped number for these ops (add, mul, ...);
    // for the others the executor's Python makes it a plain 0-dim tensor (Resolved.numbers_as_tensors)
    op->wraps_numbers = torch::should_allow_numbers_as_tensors(name);
    for (const c10::Argument& a : h->schema().arguments()) {
      Arg arg;
      if (!kind_of(a, on_cuda_, arg)) return false;
      arg.optional = arg.optional || (op->recipe != nullptr && arg.kind == Kind::Tensor);  // undefined: None
      arg.kwarg_only = a.kwarg_only();
      arg.name = steal(PyUnicode_InternFromString(a.name().c_str()));
      arg.dflt = a.default_value();
      op->args.push_back(std::move(arg));
    }
    for (py::handle c : checked) op->checked.push_back(c.cast<py::tuple>()[0].cast<size_t>());
    ops_[index] = std::move(op);
    return true;
  }

  // Forget op #index (the executor redefines it as one this path does not run).
  void undefine(int64_t index) { ops_.erase(index); }

  // A whole op message ([Msg.OP, events, index, args, kwargs, outs]), so the executor's Python is not
  // on its way: 2 when its frees are applied and the op ran here (run()); 1 when its frees are applied
  // and the op is left to Python; 0 when nothing was done (an op this path does not define, events
  // other than frees: the message is Python's whole). What the op raises propagates, frees applied.
  int op(py::handle meta) {
    PyObject* m = meta.ptr();
    int64_t index;
    if (!PyList_CheckExact(m) || PyList_GET_SIZE(m) != 6 || !as_int(PyList_GET_ITEM(m, 2), index) ||
        ops_.find(index) == ops_.end())
      return 0;
    PyObject* events = PyList_GET_ITEM(m, 1);
    if (!PyList_CheckExact(events) || (PyList_GET_SIZE(events) != 0 && !table_->free_all(events))) return 0;
    return run(index, PyList_GET_ITEM(m, 3), PyList_GET_ITEM(m, 4), PyList_GET_ITEM(m, 5)) ? 2 : 1;
  }

  // Op #index on the wire's args, kwargs and output descriptors: true when it ran and its outputs are
  // bound; false when it is not this path's case (nothing done that the Python path would not redo).
  bool run(int64_t index, py::handle args, py::handle kwargs, py::handle outs) {
    auto found = ops_.find(index);
    if (found == ops_.end()) return false;
    ++declined;  // until it has run
    if (!PyList_CheckExact(args.ptr()) || !PyDict_CheckExact(kwargs.ptr())) return false;
    Op& op = *found->second;
    const auto t0 = std::chrono::steady_clock::now();
    const Py_ssize_t npos = PyList_GET_SIZE(args.ptr());
    if (npos > static_cast<Py_ssize_t>(op.args.size())) return false;
    torch::jit::Stack stack;
    stack.reserve(op.args.size());
    inputs_.clear();
    Py_ssize_t named = 0;
    for (size_t i = 0; i < op.args.size(); ++i) {
      const Arg& a = op.args[i];
      if (a.kwarg_only && static_cast<Py_ssize_t>(i) < npos) return false;  // Python refuses it, by name
      PyObject* v = static_cast<Py_ssize_t>(i) < npos ? PyList_GET_ITEM(args.ptr(), i) : nullptr;
      if (v == nullptr && (v = PyDict_GetItem(kwargs.ptr(), a.name.ptr())) != nullptr) ++named;
      if (v == nullptr) {
        if (!a.dflt) return false;  // the Python path names what is missing
        stack.push_back(*a.dflt);
      } else if (!value(op, a, v, stack)) {
        return false;
      }
    }
    if (named != PyDict_GET_SIZE(kwargs.ptr())) return false;  // an unknown keyword: Python says which
    written_.clear();
    for (size_t pos : op.checked) written_.push_back(stack[pos]);  // the stack holds the results afterwards
    --declined;
    ++ran;
    const auto t1 = std::chrono::steady_clock::now();
    {
      py::gil_scoped_release no_gil;
      if (op.recipe != nullptr) op.recipe(stack);
      else op.handle.callBoxed(stack);
    }
    const auto t2 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < op.checked.size(); ++i) check_written(op.args[op.checked[i]], op.checked[i], written_[i], args, kwargs);
    bind(stack, outs);
    stack_ns += ns(t1 - t0);
    call_ns += ns(t2 - t1);
    bind_ns += ns(std::chrono::steady_clock::now() - t2);
    return true;
  }

  // A whole upload (Msg.UPLOAD: a training step's batch), after its frees (fast_copies.h); false for Python.
  bool upload(py::handle events, py::handle desc, py::handle data) {
    if (!upload_whole(*table_, events, desc, data)) return false;
    ++uploads;
    return true;
  }

  // A small download's bytes (Msg.DOWNLOAD), after its frees (fast_copies.h); None for Python.
  py::object download(py::handle events, py::handle desc, size_t max_bytes) {
    py::object got = download_small(*table_, events, desc, max_bytes);
    if (!got.is_none()) ++downloads;
    return got;
  }

  int64_t ran = 0, declined = 0;  // ops run here (failed ones too); ops defined here but left to Python
  int64_t uploads = 0, downloads = 0;  // whole uploads, small downloads done here
  // where the time of the ops run here went (rgpu.bench.server_ops shows it): the wire's values to a
  // boxed stack (the handle table's views and fresh outputs included), the op itself (the dispatcher's
  // call and the kernel's launch), the written arguments' check and the outputs' binding
  int64_t stack_ns = 0, call_ns = 0, bind_ns = 0;
  int64_t table_ns = 0;           // of stack_ns: the handle table's part (views looked up or made, fresh outputs)

 private:
  static int64_t ns(std::chrono::steady_clock::duration d) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
  }

  // One wire value as the schema's type, pushed; false for what this path does not take.
  bool value(const Op& op, const Arg& a, PyObject* v, torch::jit::Stack& stack) {
    if (v == Py_None) {
      if (!a.optional && a.kind != Kind::Generator) return false;
      stack.emplace_back();
      return true;
    }
    switch (a.kind) {
      case Kind::Tensor: {
        at::Tensor t;
        if (!wire_tensor(v, t) && (op.recipe != nullptr || !number_tensor(v, op.wraps_numbers, t))) return false;
        stack.emplace_back(std::move(t));
        return true;
      }
      case Kind::TensorList: case Kind::OptTensorList: {
        if (!PyList_CheckExact(v)) return false;
        const Py_ssize_t n = PyList_GET_SIZE(v);
        if (a.kind == Kind::TensorList) {
          c10::List<at::Tensor> list;
          list.reserve(n);
          for (Py_ssize_t i = 0; i < n; ++i) {
            at::Tensor t;
            if (!wire_tensor(PyList_GET_ITEM(v, i), t)) return false;
            list.push_back(std::move(t));
          }
          stack.emplace_back(std::move(list));
        } else {
          c10::List<std::optional<at::Tensor>> list;
          list.reserve(n);
          for (Py_ssize_t i = 0; i < n; ++i) {
            PyObject* x = PyList_GET_ITEM(v, i);
            if (x == Py_None) {
              list.push_back(std::nullopt);
              continue;
            }
            at::Tensor t;
            if (!wire_tensor(x, t)) return false;
            list.push_back(std::move(t));
          }
          stack.emplace_back(std::move(list));
        }
        return true;
      }
      case Kind::Int: {
        int64_t i;
        if (PyBool_Check(v) || !as_int(v, i)) return false;   // a bool for an int: Python's to refuse
        stack.emplace_back(i);
        return true;
      }
      case Kind::IntList: case Kind::BoolList: {
        if (!PyList_CheckExact(v)) return false;
        const Py_ssize_t n = PyList_GET_SIZE(v);
        if (a.kind == Kind::BoolList) {
          c10::List<bool> list;
          for (Py_ssize_t i = 0; i < n; ++i) {
            PyObject* x = PyList_GET_ITEM(v, i);
            if (!PyBool_Check(x)) return false;
            list.push_back(x == Py_True);
          }
          stack.emplace_back(std::move(list));
          return true;
        }
        c10::List<int64_t> list;
        list.reserve(n);
        for (Py_ssize_t i = 0; i < n; ++i) {
          int64_t x;
          if (PyBool_Check(PyList_GET_ITEM(v, i)) || !as_int(PyList_GET_ITEM(v, i), x)) return false;
          list.push_back(x);
        }
        stack.emplace_back(std::move(list));
        return true;
      }
      case Kind::Float:
        if (PyFloat_CheckExact(v)) {
          stack.emplace_back(PyFloat_AS_DOUBLE(v));
          return true;
        } else {
          int64_t i;
          if (PyBool_Check(v) || !as_int(v, i)) return false;
          stack.emplace_back(static_cast<double>(i));
          return true;
        }
      case Kind::Bool:
        if (!PyBool_Check(v)) return false;
        stack.emplace_back(v == Py_True);
        return true;
      case Kind::Scalar: {
        c10::IValue x;
        if (!number(v, x)) return false;  // complex, a scalar tensor: the Python path
        stack.push_back(std::move(x));
        return true;
      }
      case Kind::ScalarList: {
        if (!PyList_CheckExact(v)) return false;
        c10::impl::GenericList list(c10::NumberType::get());
        const Py_ssize_t n = PyList_GET_SIZE(v);
        list.reserve(n);
        for (Py_ssize_t i = 0; i < n; ++i) {
          c10::IValue x;
          if (!number(PyList_GET_ITEM(v, i), x)) return false;
          list.push_back(std::move(x));
        }
        stack.emplace_back(std::move(list));
        return true;
      }
      case Kind::ScalarType: {
        PyObject* code = tagged(v, tags_[1].ptr());
        int64_t c;
        if (code == nullptr || !as_int(code, c) || !table_->dtype(c)) return false;
        stack.emplace_back(static_cast<int64_t>(*table_->dtype(c)));
        return true;
      }
      case Kind::Device: {
        PyObject* d = tagged(v, tags_[2].ptr());
        if (d == nullptr || !PyList_CheckExact(d) || PyList_GET_SIZE(d) != 2) return false;
        PyObject* kind = PyList_GET_ITEM(d, 0);
        int64_t i = 0;
        if (!PyUnicode_Check(kind) || PyUnicode_CompareWithASCIIString(kind, "rgpu") != 0) return false;
        if (PyList_GET_ITEM(d, 1) != Py_None && !as_int(PyList_GET_ITEM(d, 1), i)) return false;
        if (!table_->usable(i)) return false;  // the Python path names what is wrong with it
        stack.emplace_back(table_->devices[i]);
        return true;
      }
      case Kind::Layout: {
        PyObject* name = tagged(v, tags_[3].ptr());
        if (name == nullptr || !PyUnicode_Check(name) || PyUnicode_CompareWithASCIIString(name, "strided") != 0) return false;
        stack.emplace_back(static_cast<int64_t>(at::kStrided));
        return true;
      }
      case Kind::MemoryFormat: {
        PyObject* name = tagged(v, tags_[4].ptr());
        if (name == nullptr || !PyUnicode_Check(name)) return false;
        static const std::pair<const char*, at::MemoryFormat> formats[] = {
            {"contiguous_format", at::MemoryFormat::Contiguous}, {"preserve_format", at::MemoryFormat::Preserve},
            {"channels_last", at::MemoryFormat::ChannelsLast}, {"channels_last_3d", at::MemoryFormat::ChannelsLast3d}};
        for (const auto& [n, f] : formats) {
          if (PyUnicode_CompareWithASCIIString(name, n) == 0) {
            stack.emplace_back(static_cast<int64_t>(f));
            return true;
          }
        }
        return false;
      }
      case Kind::Str: {
        if (!PyUnicode_Check(v)) return false;
        Py_ssize_t n;
        const char* s = PyUnicode_AsUTF8AndSize(v, &n);
        if (s == nullptr) throw py::error_already_set();
        stack.emplace_back(std::string(s, n));
        return true;
      }
      case Kind::Generator: return false;  // an explicit generator: the Python path seeds its stream
    }
    return false;
  }

  // A wire tensor ({"t": descriptor}) as the table's tensor; false for anything else.
  bool wire_tensor(PyObject* v, at::Tensor& out) {
    PyObject* desc = tagged(v, tags_[0].ptr());
    return desc != nullptr && tensor(desc, out);
  }

  // A wire number (bool, float or int) as a Scalar's value; false for anything else.
  static bool number(PyObject* v, c10::IValue& out) {
    int64_t i;
    if (PyBool_Check(v)) out = v == Py_True;
    else if (PyFloat_CheckExact(v)) out = PyFloat_AS_DOUBLE(v);
    else if (as_int(v, i)) out = i;
    else return false;
    return true;
  }

  // A number where the schema says Tensor (``y + 1.0`` reaches add.out so) as the Python path makes it:
  // a CPU 0-dim tensor of the number's type (bool, int64, float64), a wrapped number where torch.ops
  // would wrap it (type promotion reads it as a Python number then); false for anything else.
  static bool number_tensor(PyObject* v, bool wrapped, at::Tensor& out) {
    c10::IValue x;
    if (!number(v, x)) return false;
    const at::Scalar s = x.toScalar();
    out = at::scalar_to_tensor(s);  // on the CPU, without the dispatcher
    if (wrapped) out.unsafeGetTensorImpl()->set_wrapped_number(true);
    return true;
  }

  // A tensor argument: the table's view, its storage's address kept (outputs must not alias it); false for
  // a malformed descriptor (the Python path says what is wrong with it). What the table raises propagates.
  bool tensor(PyObject* desc, at::Tensor& out) {
    const auto t0 = std::chrono::steady_clock::now();
    Desc d;
    if (!d.parse(desc)) return false;
    std::optional<int64_t> read;
    out = table_->view(d, read);
    table_ns += ns(std::chrono::steady_clock::now() - t0);
    inputs_.push_back(out.storage().data_ptr().get());
    return true;
  }

  // HandleTable.keep's test: ``t`` (a written argument) still has the descriptor's layout and storage.
  bool keeps(const at::Tensor& t, PyObject* desc) {
    Desc d;
    if (!d.parse(desc) || !HandleTable::laid_out(t, d)) return false;
    const Entry* e = table_->find(d.sid);
    return e == nullptr || e->ptr == reinterpret_cast<int64_t>(t.storage().data_ptr().get());
  }

  // After an op that wrote argument ``pos`` (``written``, as passed): whether each written tensor kept the
  // client's layout (HandleTable.keep's test); the executor's Python deals with any that did not.
  void check_written(const Arg& a, size_t pos, const c10::IValue& written, py::handle args, py::handle kwargs) {
    PyObject* wire = static_cast<Py_ssize_t>(pos) < PyList_GET_SIZE(args.ptr())   // where run() found it
                         ? PyList_GET_ITEM(args.ptr(), pos) : PyDict_GetItem(kwargs.ptr(), a.name.ptr());
    if (wire == nullptr || wire == Py_None) return;
    bool same = true;
    if (written.isTensor()) {
      PyObject* desc = tagged(wire, tags_[0].ptr());
      same = desc != nullptr && keeps(written.toTensor(), desc);
    } else if (written.isTensorList() && PyList_CheckExact(wire)) {
      auto list = written.toTensorList();
      for (size_t i = 0; same && i < list.size() && static_cast<Py_ssize_t>(i) < PyList_GET_SIZE(wire); ++i) {
        PyObject* desc = tagged(PyList_GET_ITEM(wire, i), tags_[0].ptr());
        same = desc == nullptr || keeps(list.get(i), desc);
      }
    }
    if (!same) on_written_(a.name, a.kwarg_only, torch::jit::toPyObject(written), py::handle(wire));
  }

  // The op's results bound to the ids the client minted: each in the client's layout and none an
  // input or another result (else the executor's Python copies it), like Executor._bind.
  void bind(torch::jit::Stack& results, py::handle outs) {
    if (outs.is_none() || !PyList_CheckExact(outs.ptr()) || PyList_GET_SIZE(outs.ptr()) == 0) return;
    std::vector<at::Tensor> flat;
    bool plain = true;
    for (const c10::IValue& r : results) {
      if (r.isTensor()) flat.push_back(r.toTensor());
      else if (r.isTensorList()) for (const at::Tensor& t : r.toTensorList().vec()) flat.push_back(t);
      else if (r.isNone() || r.isInt() || r.isDouble() || r.isBool()) flat.emplace_back();
      else plain = false;
    }
    const Py_ssize_t n = std::min(PyList_GET_SIZE(outs.ptr()), static_cast<Py_ssize_t>(flat.size()));
    std::vector<Desc> descs(n);
    for (Py_ssize_t i = 0; plain && i < n; ++i) {
      PyObject* desc = PyList_GET_ITEM(outs.ptr(), i);
      if (desc == Py_None) continue;
      const at::Tensor& t = flat[i];
      const Desc& d = descs[i];
      if (!t.defined() || !descs[i].parse(desc) || !PyLong_CheckExact(PySequence_Fast_GET_ITEM(desc, 0)) ||
          !HandleTable::laid_out(t, d) || table_->dtype(d.code) != t.scalar_type() || d.dev < 0 ||
          d.dev >= static_cast<int64_t>(table_->devices.size())) {
        plain = false;
        break;
      }
      void* ptr = t.storage().data_ptr().get();
      if (ptr != nullptr) {
        for (void* p : inputs_) plain = plain && p != ptr;
        if (!plain) break;
        inputs_.push_back(ptr);
      }
    }
    if (!plain) {  // the executor's _bind: says what is wrong, or copies what needs copying
      py::list ptrs;
      size_t nin = inputs_.size();
      for (size_t i = 0; i < nin; ++i) ptrs.append(reinterpret_cast<int64_t>(inputs_[i]));
      py::list values;
      for (c10::IValue& r : results) {
        py::object o = torch::jit::toPyObject(std::move(r));
        if (PyTuple_Check(o.ptr()) || PyList_Check(o.ptr())) for (py::handle x : o) values.append(x);
        else values.append(o);
      }
      on_bind_(values, outs, ptrs);
      return;
    }
    for (Py_ssize_t i = 0; i < n; ++i)
      if (PyList_GET_ITEM(outs.ptr(), i) != Py_None) table_->bind(descs[i].sid, flat[i].storage(), descs[i].dev, &descs[i], &flat[i]);
  }

  std::shared_ptr<HandleTable> table_;
  py::object on_written_, on_bind_;
  bool on_cuda_;
  std::vector<py::object> tags_;
  std::unordered_map<int64_t, std::unique_ptr<Op>> ops_;
  std::vector<void*> inputs_;               // base addresses of the storages the op read
  std::vector<c10::IValue> written_;        // the written arguments' values, as passed
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  rgpu_server::bind_handle_table(m);
  py::class_<FastOps>(m, "FastOps")
      .def(py::init<std::shared_ptr<HandleTable>, bool, py::object, py::object>())
      .def("define", &FastOps::define)
      .def("undefine", &FastOps::undefine)
      .def("op", torch::wrap_pybind_function([](FastOps& self, py::handle meta) { return self.op(meta); }))
      .def_readonly("ran", &FastOps::ran)
      .def_readonly("declined", &FastOps::declined)
      .def_readonly("stack_ns", &FastOps::stack_ns)
      .def_readonly("table_ns", &FastOps::table_ns)
      .def_readonly("call_ns", &FastOps::call_ns)
      .def_readonly("bind_ns", &FastOps::bind_ns)
      .def_readonly("uploads", &FastOps::uploads)
      .def_readonly("downloads", &FastOps::downloads)
      .def("upload", torch::wrap_pybind_function(
                         [](FastOps& self, py::handle events, py::handle desc, py::handle data) {
                           return self.upload(events, desc, data);
                         }))
      .def("download", torch::wrap_pybind_function(
                           [](FastOps& self, py::handle events, py::handle desc, size_t max_bytes) {
                             return self.download(events, desc, max_bytes);
                           }))
      .def("run", torch::wrap_pybind_function(
                      [](FastOps& self, int64_t index, py::handle args, py::handle kwargs, py::handle outs) {
                        return self.run(index, args, kwargs, outs);
                      }));
}
