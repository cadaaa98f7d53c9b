// The ops route's common case in C++: one streamed op (Msg.OP) decoded, run and bound without Python.
//
// Why: on the GPU host the executor's Python around each aten call (decoding the wire's values, the
// view cache, the op's own argument parsing, binding the outputs) was ~3/4 of the server's time per
// op, and in an eager training step the server, not the GPU, set the pace. Here the wire's values
// (already unpacked by msgpack) become a boxed stack by the op's schema, the cached views come
// straight out of the Python handle table's dicts, and the op runs through the dispatcher.
//
// The Python executor stays the reference and the rest: run() answers false, having changed
// nothing the Python path would not do the same way, for anything it does not take (a tagged value
// other than a tensor, dtype, device, layout or memory format; a number where the schema says
// Tensor; an unknown keyword), and an op with an argument type it does not know, a substitute, a
// CPU adaptation or a generator on the CPU is never defined here. Whatever is unusual after the op
// ran (a written view whose layout changed, an output in another layout than the client's, one that
// aliases an input) goes back to the executor's own Python for that part.
#include <torch/extension.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

enum class Kind : uint8_t {
  Tensor, TensorList, OptTensorList, Int, IntList, Float, Bool, BoolList, Scalar, ScalarList, ScalarType, Layout,
  MemoryFormat, Device, Str, Generator
};

struct Arg {
  Kind kind;
  bool optional, kwarg_only;
  py::object name;                   // interned, for the kwargs dict
  std::optional<c10::IValue> dflt;   // the schema's default, when it has one
};

struct Op {
  c10::OperatorHandle handle;
  std::vector<Arg> args;
  std::vector<size_t> checked;       // positions of written arguments whose layout is checked afterwards
  explicit Op(c10::OperatorHandle h) : handle(std::move(h)) {}
};

// Why a one-kind-per-type table: the wire carries msgpack values; the schema says what each must become.
bool kind_of(const c10::Argument& a, bool on_cuda, Arg& out) {
  c10::TypePtr t = a.real_type();
  out.optional = false;
  if (auto o = t->castRaw<c10::OptionalType>()) {
    out.optional = true;
    t = o->getElementType();
  }
  switch (t->kind()) {
    case c10::TypeKind::TensorType: out.kind = Kind::Tensor; return true;
    case c10::TypeKind::IntType: case c10::TypeKind::SymIntType: out.kind = Kind::Int; return true;
    case c10::TypeKind::FloatType: case c10::TypeKind::SymFloatType: out.kind = Kind::Float; return true;
    case c10::TypeKind::BoolType: case c10::TypeKind::SymBoolType: out.kind = Kind::Bool; return true;
    case c10::TypeKind::NumberType: out.kind = Kind::Scalar; return true;
    case c10::TypeKind::StringType: out.kind = Kind::Str; return true;
    case c10::TypeKind::ScalarTypeType: out.kind = Kind::ScalarType; return true;
    case c10::TypeKind::LayoutType: out.kind = Kind::Layout; return true;
    case c10::TypeKind::MemoryFormatType: out.kind = Kind::MemoryFormat; return true;
    case c10::TypeKind::DeviceObjType: out.kind = Kind::Device; return true;
    case c10::TypeKind::GeneratorType: out.kind = Kind::Generator; return on_cuda;  // the CPU picks its own
    case c10::TypeKind::ListType: {
      c10::TypePtr e = t->castRaw<c10::ListType>()->getElementType();
      if (out.optional && e->kind() != c10::TypeKind::IntType && e->kind() != c10::TypeKind::SymIntType) return false;
      switch (e->kind()) {
        case c10::TypeKind::TensorType: out.kind = Kind::TensorList; return true;
        case c10::TypeKind::IntType: case c10::TypeKind::SymIntType: out.kind = Kind::IntList; return true;
        case c10::TypeKind::BoolType: out.kind = Kind::BoolList; return true;
        case c10::TypeKind::NumberType: out.kind = Kind::ScalarList; return true;
        case c10::TypeKind::OptionalType:
          if (e->castRaw<c10::OptionalType>()->getElementType()->kind() != c10::TypeKind::TensorType) return false;
          out.kind = Kind::OptTensorList;
          return true;
        default: return false;
      }
    }
    default: return false;
  }
}

bool as_int(PyObject* v, int64_t& out) {
  if (!PyLong_Check(v)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(v, &overflow);
  return !overflow && !(out == -1 && PyErr_Occurred());
}

// A wire value {"tag": x} with one key: x, else nullptr.
PyObject* tagged(PyObject* v, PyObject* tag) {
  if (!PyDict_CheckExact(v) || PyDict_GET_SIZE(v) != 1) return nullptr;
  return PyDict_GetItem(v, tag);
}

bool same_ints(c10::IntArrayRef have, PyObject* list) {
  if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) != static_cast<Py_ssize_t>(have.size())) return false;
  for (size_t i = 0; i < have.size(); ++i) {
    int64_t v;
    if (!as_int(PyList_GET_ITEM(list, i), v) || v != have[i]) return false;
  }
  return true;
}

py::object steal(PyObject* p) {
  if (p == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(p);
}

class FastOps {
 public:
  // table: the session's HandleTable (its entries dict, Entry class and accounting lists are used in
  // place, so both paths see one table); dtypes: its dtype per wire code (None where this torch lacks
  // one); written(name, kwarg_only, tensor, wire) and bind(results, outs, input_ptrs): the executor's own
  // Python for what is unusual after an op ran.
  FastOps(py::object table, py::object entry_type, int64_t max_views, py::sequence dtypes, bool on_cuda,
          py::object written, py::object bind)
      : table_(table), entries_(table.attr("entries")), entry_type_(entry_type), on_written_(written),
        on_bind_(bind), on_cuda_(on_cuda), max_views_(max_views) {
    for (py::handle d : dtypes) {
      dtype_objs_.push_back(py::reinterpret_borrow<py::object>(d));
      dtypes_.push_back(THPDtype_Check(d.ptr()) ? std::optional<at::ScalarType>(((THPDtype*)d.ptr())->scalar_type)
                                               : std::nullopt);
    }
    for (py::handle d : table.attr("devices")) devices_.push_back(((THPDevice*)d.ptr())->device);
    for (const char* k : {"t", "d", "v", "l", "m"}) tags_.push_back(steal(PyUnicode_InternFromString(k)));
    for (const char* k : {"storage", "device", "flat", "views", "poison", "ptr"}) slots_.push_back(steal(PyUnicode_InternFromString(k)));
    s_view_ = steal(PyUnicode_InternFromString("view"));
    s_allocated_ = steal(PyUnicode_InternFromString("allocated"));
    s_peak_ = steal(PyUnicode_InternFromString("peak"));
  }

  // Whether op #index (aten::name.overload; "default" is the unnamed overload) runs here; checked:
  // the executor's (position, name, keyword-only) of written arguments it checks after the op.
  bool define(int64_t index, const std::string& name, const std::string& overload, py::list checked) {
    ops_.erase(index);
    auto h = c10::Dispatcher::singleton().findSchema({"aten::" + name, overload == "default" ? "" : overload});
    if (!h) return false;
    auto op = std::make_unique<Op>(*h);
    for (const c10::Argument& a : h->schema().arguments()) {
      Arg arg;
      if (!kind_of(a, on_cuda_, arg)) return false;
      arg.kwarg_only = a.kwarg_only();
      arg.name = steal(PyUnicode_InternFromString(a.name().c_str()));
      arg.dflt = a.default_value();
      op->args.push_back(std::move(arg));
    }
    for (py::handle c : checked) op->checked.push_back(c.cast<py::tuple>()[0].cast<size_t>());
    ops_[index] = std::move(op);
    return true;
  }

  // Op #index on the wire's args, kwargs and output descriptors: true when it ran and its outputs are
  // bound; false when it is not this path's case (nothing done that the Python path would not redo).
  bool run(int64_t index, py::handle args, py::handle kwargs, py::handle outs) {
    auto found = ops_.find(index);
    if (found == ops_.end()) return false;
    ++declined;  // until it has run
    if (!PyList_CheckExact(args.ptr()) || !PyDict_CheckExact(kwargs.ptr())) return false;
    Op& op = *found->second;
    const Py_ssize_t npos = PyList_GET_SIZE(args.ptr());
    if (npos > static_cast<Py_ssize_t>(op.args.size())) return false;
    torch::jit::Stack stack;
    stack.reserve(op.args.size());
    inputs_.clear();
    Py_ssize_t named = 0;
    for (size_t i = 0; i < op.args.size(); ++i) {
      const Arg& a = op.args[i];
      PyObject* v = static_cast<Py_ssize_t>(i) < npos ? PyList_GET_ITEM(args.ptr(), i) : nullptr;
      if (v == nullptr && (v = PyDict_GetItem(kwargs.ptr(), a.name.ptr())) != nullptr) ++named;
      if (v == nullptr) {
        if (!a.dflt) return false;  // the Python path names what is missing
        stack.push_back(*a.dflt);
      } else if (!value(a, v, stack)) {
        return false;
      }
    }
    if (named != PyDict_GET_SIZE(kwargs.ptr())) return false;  // an unknown keyword: Python says which
    written_.clear();
    for (size_t pos : op.checked) written_.push_back(stack[pos]);  // the stack holds the results afterwards
    --declined;
    ++ran;
    const auto t0 = std::chrono::steady_clock::now();
    {
      py::gil_scoped_release no_gil;
      op.handle.callBoxed(stack);
    }
    call_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    for (size_t i = 0; i < op.checked.size(); ++i) check_written(op.args[op.checked[i]], op.checked[i], written_[i], args, kwargs);
    bind(stack, outs);
    return true;
  }

  int64_t ran = 0, declined = 0;  // ops run here (failed ones too); ops defined here but left to Python
  int64_t call_ns = 0;            // time in the ops themselves (the dispatcher's call and the kernels' launch)

 private:
  // One wire value as the schema's type, pushed; false for what this path does not take.
  bool value(const Arg& a, PyObject* v, torch::jit::Stack& stack) {
    if (v == Py_None) {
      if (!a.optional && a.kind != Kind::Generator) return false;
      stack.emplace_back();
      return true;
    }
    switch (a.kind) {
      case Kind::Tensor: {
        PyObject* desc = tagged(v, tags_[0].ptr());
        at::Tensor t;
        if (desc == nullptr || !tensor(desc, t)) return false;
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
            PyObject* desc = tagged(PyList_GET_ITEM(v, i), tags_[0].ptr());
            at::Tensor t;
            if (desc == nullptr || !tensor(desc, t)) return false;
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
            PyObject* desc = tagged(x, tags_[0].ptr());
            at::Tensor t;
            if (desc == nullptr || !tensor(desc, t)) return false;
            list.push_back(std::move(t));
          }
          stack.emplace_back(std::move(list));
        }
        return true;
      }
      case Kind::Int: {
        int64_t i;
        if (!as_int(v, i)) return false;
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
          if (!as_int(PyList_GET_ITEM(v, i), x)) return false;
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
        int64_t i;
        if (PyBool_Check(v)) stack.emplace_back(v == Py_True);
        else if (PyFloat_CheckExact(v)) stack.emplace_back(PyFloat_AS_DOUBLE(v));
        else if (as_int(v, i)) stack.emplace_back(i);
        else return false;  // complex, a scalar tensor: the Python path
        return true;
      }
      case Kind::ScalarList: {
        if (!PyList_CheckExact(v)) return false;
        c10::impl::GenericList list(c10::NumberType::get());
        const Py_ssize_t n = PyList_GET_SIZE(v);
        list.reserve(n);
        for (Py_ssize_t i = 0; i < n; ++i) {
          PyObject* x = PyList_GET_ITEM(v, i);
          int64_t k;
          if (PyBool_Check(x)) list.push_back(x == Py_True);
          else if (PyFloat_CheckExact(x)) list.push_back(PyFloat_AS_DOUBLE(x));
          else if (as_int(x, k)) list.push_back(k);
          else return false;
        }
        stack.emplace_back(std::move(list));
        return true;
      }
      case Kind::ScalarType: {
        PyObject* code = tagged(v, tags_[1].ptr());
        int64_t c;
        if (code == nullptr || !as_int(code, c) || c < 0 || c >= static_cast<int64_t>(dtypes_.size()) || !dtypes_[c]) return false;
        stack.emplace_back(static_cast<int64_t>(*dtypes_[c]));
        return true;
      }
      case Kind::Device: {
        PyObject* d = tagged(v, tags_[2].ptr());
        if (d == nullptr || !PyList_CheckExact(d) || PyList_GET_SIZE(d) != 2) return false;
        PyObject* kind = PyList_GET_ITEM(d, 0);
        int64_t i = 0;
        if (!PyUnicode_Check(kind) || PyUnicode_CompareWithASCIIString(kind, "rgpu") != 0) return false;
        if (PyList_GET_ITEM(d, 1) != Py_None && !as_int(PyList_GET_ITEM(d, 1), i)) return false;
        if (i < 0 || i >= static_cast<int64_t>(devices_.size())) return false;
        stack.emplace_back(devices_[i]);
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

  enum Slot { STORAGE, DEVICE, FLAT, VIEWS, POISON, PTR };
  py::object slot(PyObject* entry, Slot s) { return steal(PyObject_GetAttr(entry, slots_[s].ptr())); }

  // The tensor a descriptor names, into ``out``, as HandleTable.view gives it: the cached view; else
  // one built from the storage's flat tensor and cached; a storage first named here (an op's out=
  // tensor) allocated as that tensor when it is exactly its storage. A poisoned storage raises its
  // Poisoned; anything else (a malformed descriptor, a view of a storage that needs bytes first)
  // is the table's own view() to do or to refuse (false only for a malformed descriptor).
  bool tensor(PyObject* desc, at::Tensor& out) {
    if (!PyList_CheckExact(desc) || PyList_GET_SIZE(desc) != 7 || !PyList_CheckExact(PyList_GET_ITEM(desc, 3)) ||
        !PyList_CheckExact(PyList_GET_ITEM(desc, 4)))
      return false;
    PyObject* sid = PyList_GET_ITEM(desc, 0);
    py::object key = steal(PyTuple_Pack(4, PyList_GET_ITEM(desc, 2), steal(PyList_AsTuple(PyList_GET_ITEM(desc, 3))).ptr(),
                                        steal(PyList_AsTuple(PyList_GET_ITEM(desc, 4))).ptr(), PyList_GET_ITEM(desc, 5)));
    PyObject* entry = PyDict_GetItem(entries_.ptr(), sid);
    if (entry != nullptr) {
      py::object poison = slot(entry, POISON);
      if (!poison.is_none()) {
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(poison.ptr())), poison.ptr());
        throw py::error_already_set();
      }
      py::object views = slot(entry, VIEWS);
      PyObject* cached = PyDict_GetItemWithError(views.ptr(), key.ptr());
      if (cached == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (cached != nullptr) {
        out = THPVariable_Unpack(cached);
      } else if (!view_of(entry, desc, views, key, out)) {
        return from_table(desc, out);
      }
    } else if (!fresh(desc, key, out)) {
      return from_table(desc, out);
    }
    inputs_.push_back(out.storage().data_ptr().get());
    return true;
  }

  bool from_table(PyObject* desc, at::Tensor& out) {
    py::list ptrs;
    py::object got = table_.attr(s_view_)(py::handle(desc), ptrs);
    if (!THPVariable_Check(got.ptr())) throw py::type_error("HandleTable.view returned no tensor");
    out = THPVariable_Unpack(got.ptr());
    inputs_.push_back(out.storage().data_ptr().get());
    return true;
  }

  // The descriptor's fields as C values; false if one is not what HandleTable expects.
  bool fields(PyObject* desc, int64_t& code, std::vector<int64_t>& size, std::vector<int64_t>& stride,
              int64_t& offset, int64_t& dev) {
    if (!as_int(PyList_GET_ITEM(desc, 2), code) || code < 0 || code >= static_cast<int64_t>(dtypes_.size()) ||
        !dtypes_[code] || !as_int(PyList_GET_ITEM(desc, 5), offset) || !as_int(PyList_GET_ITEM(desc, 6), dev) ||
        dev < 0 || dev >= static_cast<int64_t>(devices_.size()))
      return false;
    for (auto [list, into] : {std::pair{PyList_GET_ITEM(desc, 3), &size}, std::pair{PyList_GET_ITEM(desc, 4), &stride}}) {
      const Py_ssize_t n = PyList_GET_SIZE(list);
      into->resize(n);
      for (Py_ssize_t i = 0; i < n; ++i)
        if (!as_int(PyList_GET_ITEM(list, i), (*into)[i])) return false;
    }
    return size.size() == stride.size();
  }

  // A view of an entry's storage the cache lacks: HandleTable.tensor's flat tensor and as_strided (which
  // checks the geometry against the storage), then cached as HandleTable.view does.
  bool view_of(PyObject* entry, PyObject* desc, py::object& views, py::object& key, at::Tensor& out) {
    int64_t code, offset, dev;
    std::vector<int64_t> size, stride;
    py::object storage = slot(entry, STORAGE);
    if (!fields(desc, code, size, stride, offset, dev) || !THPStorage_Check(storage.ptr())) return false;
    py::object flats = slot(entry, FLAT);
    PyObject* flat = PyDict_GetItemWithError(flats.ptr(), dtype_objs_[code].ptr());
    if (flat == nullptr && PyErr_Occurred()) throw py::error_already_set();
    at::Tensor f;
    if (flat != nullptr) {
      f = THPVariable_Unpack(flat);
    } else {
      const c10::Storage& st = THPStorage_Unpack(storage.ptr());
      f = at::empty({0}, at::TensorOptions().dtype(*dtypes_[code]).device(st.device()));
      f.set_(st);
      py::object wrapped = steal(THPVariable_Wrap(f));
      if (PyDict_SetItem(flats.ptr(), dtype_objs_[code].ptr(), wrapped.ptr()) < 0) throw py::error_already_set();
    }
    out = f.as_strided(size, stride, offset);
    if (PyDict_GET_SIZE(views.ptr()) >= max_views_) PyDict_Clear(views.ptr());
    py::object wrapped = steal(THPVariable_Wrap(out));
    if (PyDict_SetItem(views.ptr(), key.ptr(), wrapped.ptr()) < 0) throw py::error_already_set();
    return true;
  }

  // A storage first named by an op, as HandleTable._fresh's common case: a contiguous tensor of exactly
  // the storage's bytes, allocated as that tensor; false for any other (the table's view() then).
  bool fresh(PyObject* desc, py::object& key, at::Tensor& out) {
    int64_t code, offset, dev, nbytes, n = 1;
    std::vector<int64_t> size, stride;
    if (!fields(desc, code, size, stride, offset, dev) || offset != 0 || !as_int(PyList_GET_ITEM(desc, 1), nbytes) ||
        !as_int(PyList_GET_ITEM(desc, 0), offset) || offset == 0)  // sid 0: a storage of no bytes
      return false;
    for (size_t i = size.size(); i-- > 0;) {
      if (size[i] < 0 || stride[i] != n) return false;
      n *= size[i];
    }
    if (n * static_cast<int64_t>(c10::elementSize(*dtypes_[code])) != nbytes) return false;
    out = at::empty(size, at::TensorOptions().dtype(*dtypes_[code]).device(devices_[dev]));
    enter(PyList_GET_ITEM(desc, 0), out, PyList_GET_ITEM(desc, 6), key, nbytes);
    return true;
  }

  // HandleTable.bind(sid, t's storage, dev, (desc, t)): a fresh Entry holding ``t`` as its view ``key``.
  void enter(PyObject* sid, const at::Tensor& t, PyObject* dev, py::object& key, int64_t nbytes) {
    release(sid);
    auto* type = reinterpret_cast<PyTypeObject*>(entry_type_.ptr());
    py::object entry = steal(type->tp_alloc(type, 0));
    py::object views = steal(PyDict_New()), wrapped = steal(THPVariable_Wrap(t));
    if (PyDict_SetItem(views.ptr(), key.ptr(), wrapped.ptr()) < 0) throw py::error_already_set();
    py::object fields[] = {steal(THPStorage_Wrap(t.storage())), py::reinterpret_borrow<py::object>(dev), steal(PyDict_New()),
                           views, py::none(), py::int_(reinterpret_cast<int64_t>(t.storage().data_ptr().get()))};
    for (int s = STORAGE; s <= PTR; ++s)
      if (PyObject_SetAttr(entry.ptr(), slots_[s].ptr(), fields[s].ptr()) < 0) throw py::error_already_set();
    if (PyDict_SetItem(entries_.ptr(), sid, entry.ptr()) < 0) throw py::error_already_set();
    account(dev, nbytes);
  }

  // HandleTable.free: the entry goes, its bytes leave the device's count.
  void release(PyObject* sid) {
    PyObject* old = PyDict_GetItem(entries_.ptr(), sid);
    if (old == nullptr) return;
    py::object entry = py::reinterpret_borrow<py::object>(old), storage = slot(old, STORAGE);
    if (PyDict_DelItem(entries_.ptr(), sid) < 0) throw py::error_already_set();
    if (THPStorage_Check(storage.ptr())) account(slot(entry.ptr(), DEVICE).ptr(), -static_cast<int64_t>(THPStorage_Unpack(storage.ptr()).nbytes()));
  }

  // HandleTable._account: allocated[dev] += nbytes, and its peak.
  void account(PyObject* dev, int64_t nbytes) {
    py::object allocated = table_.attr(s_allocated_), peak = table_.attr(s_peak_);
    py::object now = py::int_(py::reinterpret_borrow<py::object>(PyObject_GetItem(allocated.ptr(), dev)).cast<int64_t>() + nbytes);
    if (PyObject_SetItem(allocated.ptr(), dev, now.ptr()) < 0) throw py::error_already_set();
    if (nbytes > 0 && py::reinterpret_steal<py::object>(PyObject_GetItem(peak.ptr(), dev)).cast<int64_t>() < now.cast<int64_t>())
      if (PyObject_SetItem(peak.ptr(), dev, now.ptr()) < 0) throw py::error_already_set();
  }

  // After an op that wrote argument ``pos`` (``written``, as passed): whether each written tensor kept the
  // client's layout (HandleTable.keep's test); the executor's Python deals with any that did not.
  void check_written(const Arg& a, size_t pos, const c10::IValue& written, py::handle args, py::handle kwargs) {
    PyObject* wire = !a.kwarg_only && static_cast<Py_ssize_t>(pos) < PyList_GET_SIZE(args.ptr())
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

  bool keeps(const at::Tensor& t, PyObject* desc) {
    int64_t offset;
    if (!same_ints(t.sizes(), PyList_GET_ITEM(desc, 3)) || !same_ints(t.strides(), PyList_GET_ITEM(desc, 4)) ||
        !as_int(PyList_GET_ITEM(desc, 5), offset) || offset != t.storage_offset() || t.is_conj() || t.is_neg())
      return false;
    PyObject* entry = PyDict_GetItem(entries_.ptr(), PyList_GET_ITEM(desc, 0));
    if (entry == nullptr) return true;
    int64_t ptr;
    py::object p = slot(entry, PTR);
    return as_int(p.ptr(), ptr) && ptr == reinterpret_cast<int64_t>(t.storage().data_ptr().get());
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
    const Py_ssize_t n = PyList_GET_SIZE(outs.ptr());
    std::vector<py::object> binds;  // (sid, storage, dev, (desc, tensor)) for each output, once all are known good
    for (Py_ssize_t i = 0; plain && i < n && i < static_cast<Py_ssize_t>(flat.size()); ++i) {
      PyObject* desc = PyList_GET_ITEM(outs.ptr(), i);
      if (desc == Py_None) continue;
      const at::Tensor& t = flat[i];
      int64_t code, offset;
      if (!t.defined() || !PyList_CheckExact(desc) || PyList_GET_SIZE(desc) != 7 || !as_int(PyList_GET_ITEM(desc, 2), code) ||
          code < 0 || code >= static_cast<int64_t>(dtypes_.size()) || dtypes_[code] != t.scalar_type() ||
          !same_ints(t.sizes(), PyList_GET_ITEM(desc, 3)) || !same_ints(t.strides(), PyList_GET_ITEM(desc, 4)) ||
          !as_int(PyList_GET_ITEM(desc, 5), offset) || offset != t.storage_offset() || t.is_conj() || t.is_neg()) {
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
    if (!plain) {  // the executor's _bind: copies what needs copying
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
    for (Py_ssize_t i = 0; i < n && i < static_cast<Py_ssize_t>(flat.size()); ++i) {
      PyObject* desc = PyList_GET_ITEM(outs.ptr(), i);
      if (desc == Py_None) continue;
      py::object key = steal(PyTuple_Pack(4, PyList_GET_ITEM(desc, 2), steal(PyList_AsTuple(PyList_GET_ITEM(desc, 3))).ptr(),
                                          steal(PyList_AsTuple(PyList_GET_ITEM(desc, 4))).ptr(), PyList_GET_ITEM(desc, 5)));
      enter(PyList_GET_ITEM(desc, 0), flat[i], PyList_GET_ITEM(desc, 6), key, static_cast<int64_t>(flat[i].storage().nbytes()));
    }
  }

  py::object table_, entries_, entry_type_, on_written_, on_bind_;
  bool on_cuda_;
  int64_t max_views_;
  std::vector<std::optional<at::ScalarType>> dtypes_;
  std::vector<py::object> dtype_objs_;
  std::vector<c10::Device> devices_;
  std::vector<py::object> tags_, slots_;
  py::object s_view_, s_allocated_, s_peak_;
  std::unordered_map<int64_t, std::unique_ptr<Op>> ops_;
  std::vector<void*> inputs_;               // base addresses of the storages the op read
  std::vector<c10::IValue> written_;        // the written arguments' values, as passed
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<FastOps>(m, "FastOps")
      .def(py::init<py::object, py::object, int64_t, py::sequence, bool, py::object, py::object>())
      .def("define", &FastOps::define)
      .def_readonly("ran", &FastOps::ran)
      .def_readonly("declined", &FastOps::declined)
      .def_readonly("call_ns", &FastOps::call_ns)
      .def("run", torch::wrap_pybind_function(
                      [](FastOps& self, int64_t index, py::handle args, py::handle kwargs, py::handle outs) {
                        return self.run(index, args, kwargs, outs);
                      }));
}
