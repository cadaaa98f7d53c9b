// C++ access to the ops route's Python handle table (handles.py), for the op path in fast_op.cpp.
//
// Why the table stays Python: the rest of the server (uploads, graphs, CUDA graph replays, poison, the
// Python op path) reads and writes it, and one table means both paths see the same ids, views and
// byte counts. These are its methods' common cases written against its dicts and Entry objects
// (HandleTable.view, _fresh, bind, free, apply_events of frees, _account and keep's test); anything else goes to the
// table's own Python. One difference: views are made straight from the storage (strided_view), so
// the C++ path leaves an entry's ``flat`` tensors (the Python path's way to its views) alone.
#pragma once

#include "rgpu_protocol.h"  // rgpu/protocol (generated)

#include <ATen/EmptyTensor.h>
#include <torch/extension.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>
#include <vector>

namespace rgpu_server {

namespace py = pybind11;

inline bool as_int(PyObject* v, int64_t& out) {
  if (!PyLong_Check(v)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(v, &overflow);
  return !overflow && !(out == -1 && PyErr_Occurred());
}

// A wire value {"tag": x} with one key: x, else nullptr.
inline PyObject* tagged(PyObject* v, PyObject* tag) {
  if (!PyDict_CheckExact(v) || PyDict_GET_SIZE(v) != 1) return nullptr;
  return PyDict_GetItem(v, tag);
}

inline bool same_ints(c10::IntArrayRef have, PyObject* list) {
  if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) != static_cast<Py_ssize_t>(have.size())) return false;
  for (size_t i = 0; i < have.size(); ++i) {
    int64_t v;
    if (!as_int(PyList_GET_ITEM(list, i), v) || v != have[i]) return false;
  }
  return true;
}

inline py::object steal(PyObject* p) {
  if (p == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(p);
}

// A tensor of ``st``'s bytes in this geometry, as as_strided makes one but without the dispatcher and
// without HandleTable's flat tensor per dtype (GPU host, eager nanoGPT step: ~250 views a step are
// first seen, and the flat's empty + set_ and as_strided were most of their cost). False when the
// geometry does not fit the storage as as_strided checks it (negative strides or offset, past its end,
// an overflow): the table's own view() then raises what as_strided raises.
inline bool strided_view(const c10::Storage& st, at::ScalarType dtype, c10::IntArrayRef size,
                         c10::IntArrayRef stride, int64_t offset, at::Tensor& out) {
  if (offset < 0 || size.size() != stride.size()) return false;
  for (size_t i = 0; i < size.size(); ++i)
    if (size[i] < 0 || stride[i] < 0) return false;
  size_t need;
  try {
    need = at::detail::computeStorageNbytes(size, stride, c10::elementSize(dtype), static_cast<size_t>(offset));
  } catch (const c10::Error&) {
    return false;
  }
  if (need > st.nbytes()) return false;
  const c10::DispatchKeySet keys(c10::computeDispatchKey(dtype, at::kStrided, st.device()));
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(st), keys, c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_and_strides(size, stride, offset);
  out = at::Tensor(std::move(impl));
  return true;
}

inline py::object view_key(PyObject* desc) {  // HandleTable's view-cache key: (dtype code, sizes, strides, offset)
  return steal(PyTuple_Pack(4, PyList_GET_ITEM(desc, 2), steal(PyList_AsTuple(PyList_GET_ITEM(desc, 3))).ptr(),
                            steal(PyList_AsTuple(PyList_GET_ITEM(desc, 4))).ptr(), PyList_GET_ITEM(desc, 5)));
}

class Table {
 public:
  static constexpr int64_t kEventFree = RGPU_EVENT_FREE;  // [FREE, id]

  // table: the session's HandleTable; entry_type: its Entry class; max_views: its MAX_VIEWS; dtypes:
  // its dtype per wire code (None where this torch lacks one).
  Table(py::object table, py::object entry_type, int64_t max_views, py::sequence dtypes)
      : table_(table), entries_(table.attr("entries")), entry_type_(entry_type), max_views_(max_views) {
    for (py::handle d : dtypes) {
      dtypes_.push_back(THPDtype_Check(d.ptr()) ? std::optional<at::ScalarType>(((THPDtype*)d.ptr())->scalar_type)
                                               : std::nullopt);
    }
    for (py::handle d : table.attr("devices")) devices_.push_back(((THPDevice*)d.ptr())->device);
    for (const char* k : {"storage", "device", "flat", "views", "poison", "ptr"}) slots_.push_back(steal(PyUnicode_InternFromString(k)));
    s_view_ = steal(PyUnicode_InternFromString("view"));
    s_allocated_ = steal(PyUnicode_InternFromString("allocated"));
    s_peak_ = steal(PyUnicode_InternFromString("peak"));
  }

  std::optional<at::ScalarType> dtype(int64_t code) const {
    return code >= 0 && code < static_cast<int64_t>(dtypes_.size()) ? dtypes_[code] : std::nullopt;
  }
  const std::vector<c10::Device>& devices() const { return devices_; }

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
    py::object key = view_key(desc);
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
        return true;
      }
      return view_of(entry, desc, views, key, out) || from_table(desc, out);
    }
    return fresh(desc, key, out) || from_table(desc, out);
  }

  // HandleTable.bind(sid, t's storage, dev, (desc, t)) for an op's result ``t`` in the descriptor's layout.
  void bind(PyObject* desc, const at::Tensor& t) {
    py::object key = view_key(desc);
    enter(PyList_GET_ITEM(desc, 0), t, PyList_GET_ITEM(desc, 6), key, static_cast<int64_t>(t.storage().nbytes()));
  }

  // HandleTable.free of each storage an events list frees, when all its events are frees of an int id
  // (the client's allocator log between two ops: nearly always); false, nothing done, for anything
  // else (a storage grown, a malformed list), which the table's own apply_events does or refuses.
  bool free_all(PyObject* events) {
    if (!PyList_CheckExact(events) || PyList_GET_SIZE(events) % 2) return false;
    const Py_ssize_t n = PyList_GET_SIZE(events);
    int64_t kind;
    for (Py_ssize_t i = 0; i < n; i += 2)
      if (!as_int(PyList_GET_ITEM(events, i), kind) || kind != kEventFree || !PyLong_CheckExact(PyList_GET_ITEM(events, i + 1)))
        return false;
    for (Py_ssize_t i = 0; i < n; i += 2) release(PyList_GET_ITEM(events, i + 1));
    return true;
  }

  // Whether ``t`` has the layout a descriptor (a list of 7) names: sizes, strides, offset, no conjugate or
  // negative bit. The storage and dtype are the callers' to check.
  static bool laid_out(const at::Tensor& t, PyObject* desc) {
    int64_t offset;
    return PyList_CheckExact(desc) && PyList_GET_SIZE(desc) == 7 && same_ints(t.sizes(), PyList_GET_ITEM(desc, 3)) &&
           same_ints(t.strides(), PyList_GET_ITEM(desc, 4)) && as_int(PyList_GET_ITEM(desc, 5), offset) &&
           offset == t.storage_offset() && !t.is_conj() && !t.is_neg();
  }

  // HandleTable.keep's test: ``t`` (a written argument) still has the descriptor's layout and storage.
  bool keeps(const at::Tensor& t, PyObject* desc) {
    if (!laid_out(t, desc)) return false;
    PyObject* entry = PyDict_GetItem(entries_.ptr(), PyList_GET_ITEM(desc, 0));
    if (entry == nullptr) return true;
    int64_t ptr;
    py::object p = slot(entry, PTR);
    return as_int(p.ptr(), ptr) && ptr == reinterpret_cast<int64_t>(t.storage().data_ptr().get());
  }

 private:
  enum Slot { STORAGE, DEVICE, FLAT, VIEWS, POISON, PTR };
  py::object slot(PyObject* entry, Slot s) { return steal(PyObject_GetAttr(entry, slots_[s].ptr())); }

  bool from_table(PyObject* desc, at::Tensor& out) {
    py::list ptrs;
    py::object got = table_.attr(s_view_)(py::handle(desc), ptrs);
    if (!THPVariable_Check(got.ptr())) throw py::type_error("HandleTable.view returned no tensor");
    out = THPVariable_Unpack(got.ptr());
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

  // A view of an entry's storage the cache lacks (strided_view), then cached as HandleTable.view does.
  bool view_of(PyObject* entry, PyObject* desc, py::object& views, py::object& key, at::Tensor& out) {
    int64_t code, offset, dev;
    std::vector<int64_t> size, stride;
    py::object storage = slot(entry, STORAGE);
    if (!fields(desc, code, size, stride, offset, dev) || !THPStorage_Check(storage.ptr()) ||
        !strided_view(THPStorage_Unpack(storage.ptr()), *dtypes_[code], size, stride, offset, out))
      return false;
    if (PyDict_GET_SIZE(views.ptr()) >= max_views_) PyDict_Clear(views.ptr());
    py::object wrapped = steal(THPVariable_Wrap(out));
    if (PyDict_SetItem(views.ptr(), key.ptr(), wrapped.ptr()) < 0) throw py::error_already_set();
    return true;
  }

  // A storage first named by an op, as HandleTable._fresh's common case: a contiguous tensor of exactly
  // the storage's bytes, allocated as that tensor; false for any other (the table's view() then).
  bool fresh(PyObject* desc, py::object& key, at::Tensor& out) {
    int64_t sid, code, offset, dev, nbytes, n = 1;
    std::vector<int64_t> size, stride;
    if (!fields(desc, code, size, stride, offset, dev) || offset != 0 || !as_int(PyList_GET_ITEM(desc, 1), nbytes) ||
        !as_int(PyList_GET_ITEM(desc, 0), sid) || sid == 0)  // sid 0: a storage of no bytes
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
    py::object storage = slot(old, STORAGE), dev = slot(old, DEVICE);
    if (PyDict_DelItem(entries_.ptr(), sid) < 0) throw py::error_already_set();
    if (THPStorage_Check(storage.ptr())) account(dev.ptr(), -static_cast<int64_t>(THPStorage_Unpack(storage.ptr()).nbytes()));
  }

  // HandleTable._account: allocated[dev] += nbytes, and its peak.
  void account(PyObject* dev, int64_t nbytes) {
    py::object allocated = table_.attr(s_allocated_), peak = table_.attr(s_peak_);
    int64_t was, top;
    if (!as_int(steal(PyObject_GetItem(allocated.ptr(), dev)).ptr(), was)) throw py::type_error("allocated: not a count");
    py::object now = py::int_(was + nbytes);
    if (PyObject_SetItem(allocated.ptr(), dev, now.ptr()) < 0) throw py::error_already_set();
    if (nbytes > 0 && as_int(steal(PyObject_GetItem(peak.ptr(), dev)).ptr(), top) && top < was + nbytes)
      if (PyObject_SetItem(peak.ptr(), dev, now.ptr()) < 0) throw py::error_already_set();
  }

  py::object table_, entries_, entry_type_;
  int64_t max_views_;
  std::vector<std::optional<at::ScalarType>> dtypes_;
  std::vector<c10::Device> devices_;
  std::vector<py::object> slots_;
  py::object s_view_, s_allocated_, s_peak_;
};

}  // namespace rgpu_server
