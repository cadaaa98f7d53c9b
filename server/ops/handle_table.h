// The ops route's handle table in C++: storages by client-minted id, their poison, views of them and byte counts.
//
// One table per session, owned here: the C++ op path (fast_op.cpp) uses it directly, the rest of the server
// (the Python op path, uploads, graphs, CUDA graph replays, memory counts) through its Python face
// (handle_table.cpp, the same methods as handles.py's HandleTable, which stands in for it where the C++ part
// is not built). Behaviour as handles.py: the first message that names an id materialises its storage; a
// tensor is a strided view of its storage; the op path's views are cached per storage by the rest of the
// descriptor (dtype code, sizes, strides, offset) and live exactly as long as their entry. One difference:
// views are made straight from the storage (strided_view), never through a flat tensor per dtype.
#pragma once

#include "rgpu_protocol.h"  // rgpu/protocol (generated)

#include <ATen/EmptyTensor.h>
#include <c10/util/SmallVector.h>
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace rgpu_server {

namespace py = pybind11;

inline bool as_int(PyObject* v, int64_t& out) {
  if (!PyLong_Check(v)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(v, &overflow);
  return !overflow && !(out == -1 && PyErr_Occurred());
}

inline py::object steal(PyObject* p) {
  if (p == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(p);
}

// A Python exception of ``type`` (not pybind's builtin ones: torch's error wrapper makes those RuntimeError).
[[noreturn]] inline void fail(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw py::error_already_set();
}

// A tensor of ``st``'s bytes in this geometry, as as_strided makes one but without the dispatcher and
// without a flat tensor per dtype (GPU host, eager nanoGPT step: ~250 views a step are first seen, and the
// flat's empty + set_ and as_strided were most of their cost). False when the geometry does not fit the
// storage as as_strided checks it (negative strides or offset, past its end, an overflow).
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

using Ints = c10::SmallVector<int64_t, 6>;

// A wire descriptor [id, nbytes, dtype code, sizes, strides, offset, device] as C values.
struct Desc {
  int64_t sid = 0, nbytes = 0, code = 0, offset = 0, dev = 0;
  Ints size, stride;

  // From a list (or tuple) of 7 whose sizes and strides are lists (or tuples) of ints;
  // false for anything else (the Python face then says what is wrong: describe()).
  bool parse(PyObject* o) {
    if (!(PyList_CheckExact(o) || PyTuple_CheckExact(o)) || PySequence_Fast_GET_SIZE(o) != 7) return false;
    PyObject** f = PySequence_Fast_ITEMS(o);
    if (PyBool_Check(f[2]) || !as_int(f[0], sid) || !as_int(f[1], nbytes) || !as_int(f[2], code) ||
        !as_int(f[5], offset) || !as_int(f[6], dev))
      return false;
    return ints(f[3], size) && ints(f[4], stride);  // lengths that differ: as_strided says so
  }

  static bool ints(PyObject* o, Ints& into) {
    if (!(PyList_CheckExact(o) || PyTuple_CheckExact(o))) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    into.resize(n);
    for (Py_ssize_t i = 0; i < n; ++i)
      if (!as_int(PySequence_Fast_ITEMS(o)[i], into[i])) return false;
    return true;
  }
};

// One cached view: its key (the descriptor less the id, bytes and device) and the tensor.
struct View {
  int64_t code, offset;
  Ints size, stride;
  at::Tensor t;

  bool is(const Desc& d) const {
    return code == d.code && offset == d.offset && size == d.size && stride == d.stride;
  }
};

struct Entry {
  c10::Storage storage;  // none when poisoned
  int64_t device = 0;
  int64_t ptr = 0;       // the storage's address (0: poisoned)
  py::object poison;     // the Poisoned its producer raised, or null
  std::vector<View> views;

  View* cached(const Desc& d) {
    for (View& v : views)
      if (v.is(d)) return &v;
    return nullptr;
  }
};

class HandleTable {
 public:
  static constexpr int64_t kEventFree = RGPU_EVENT_FREE;  // [FREE, id]
  static constexpr int64_t kEventCopy = RGPU_EVENT_COPY;  // [COPY, dst, nbytes, device, src, count]

  // devices: rgpu index -> torch device; dtypes: the torch dtype per wire code (none where this torch
  // lacks one); max_views: cached views per storage, past it the storage's cache starts again.
  HandleTable(std::vector<c10::Device> devices, std::vector<std::optional<at::ScalarType>> dtypes, int64_t max_views)
      : devices(std::move(devices)), dtypes_(std::move(dtypes)), max_views_(max_views) {
    allocated.assign(this->devices.size(), 0);
    peak.assign(this->devices.size(), 0);
  }

  std::vector<c10::Device> devices;
  std::vector<int64_t> allocated, peak;    // bytes held per device, and the most ever held

  bool usable(int64_t index) const { return index >= 0 && index < static_cast<int64_t>(devices.size()); }

  const c10::Device& device(int64_t index) const {
    if (!usable(index))
      fail(PyExc_IndexError, "rgpu:" + std::to_string(index) + " does not exist (the server has " +
                                 std::to_string(devices.size()) + " devices)");
    return devices[index];
  }

  std::optional<at::ScalarType> dtype(int64_t code) const {
    return code >= 0 && code < static_cast<int64_t>(dtypes_.size()) ? dtypes_[code] : std::nullopt;
  }
  at::ScalarType dtype_of(int64_t code) const {
    auto d = dtype(code);
    if (!d && code >= 0 && code < static_cast<int64_t>(dtypes_.size()))   // the quantized are left out (handles.py)
      fail(PyExc_ValueError, "dtype code " + std::to_string(code) +
                                 " is not a dtype rgpu's tensors can have (quantized, or unknown to this torch)");
    if (!d) fail(PyExc_ValueError, "unknown dtype code " + std::to_string(code));
    return *d;
  }

  Entry* find(int64_t sid) {
    auto it = entries_.find(sid);
    return it == entries_.end() ? nullptr : &it->second;
  }
  const std::unordered_map<int64_t, Entry>& entries() const { return entries_; }

  [[noreturn]] static void raise_poison(const Entry& e) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.poison.ptr())), e.poison.ptr());
    throw py::error_already_set();
  }

  // sid's entry, its storage of ``nbytes`` allocated (uninitialised) when the id is new; raises its poison.
  Entry& entry(int64_t sid, int64_t nbytes, int64_t dev) {
    Entry* e = find(sid);
    if (e == nullptr) {
      at::Tensor bytes = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(device(dev)));
      return enter(sid, bytes.storage(), dev);
    }
    if (e->poison) raise_poison(*e);
    return *e;
  }

  // The tensor a descriptor names, a view of its own; ``read``: the base address of the storage read.
  at::Tensor tensor(const Desc& d, std::optional<int64_t>& read) {
    const at::ScalarType dtype = dtype_of(d.code);
    if (d.sid == 0)  // a storage of no bytes: nothing to keep
      return at::empty_strided(d.size, d.stride, at::TensorOptions().dtype(dtype).device(device(d.dev)));
    Entry& e = entry(d.sid, d.nbytes, d.dev);
    read = e.ptr;
    at::Tensor out;
    if (strided_view(e.storage, dtype, d.size, d.stride, d.offset, out)) return out;
    // what as_strided raises for a geometry the storage cannot hold
    return at::empty({0}, at::TensorOptions().dtype(dtype).device(e.storage.device()))
        .set_(e.storage).as_strided(d.size, d.stride, d.offset);
  }

  // tensor() for an op's argument: the view built for the same descriptor before, if any. The view may be
  // handed to op after op: an op that changes its layout must keep() it afterwards.
  at::Tensor view(const Desc& d, std::optional<int64_t>& read) {
    Entry* e = find(d.sid);
    if (e == nullptr) return d.sid == 0 ? tensor(d, read) : fresh(d, read);
    if (e->poison) raise_poison(*e);
    if (View* v = e->cached(d)) {
      read = e->ptr;
      return v->t;
    }
    at::Tensor t = tensor(d, read);  // checks the geometry against the storage
    cache(*e, d, t);
    return t;
  }

  // After an op that wrote ``v`` (from view(d)): whether it still has the descriptor's layout (sizes,
  // strides, offset, storage, no conjugate/negative bit); a cached view that changed is dropped.
  bool keep(const Desc& d, const at::Tensor& v) {
    Entry* e = find(d.sid);
    if (laid_out(v, d) && (e == nullptr || reinterpret_cast<int64_t>(v.storage().data_ptr().get()) == e->ptr))
      return true;
    if (e != nullptr) {
      View* c = e->cached(d);
      if (c != nullptr && c->t.unsafeGetTensorImpl() == v.unsafeGetTensorImpl()) e->views.erase(e->views.begin() + (c - e->views.data()));
    }
    return false;
  }

  static bool laid_out(const at::Tensor& v, const Desc& d) {
    return v.sizes() == c10::IntArrayRef(d.size) && v.strides() == c10::IntArrayRef(d.stride) &&
           v.storage_offset() == d.offset && !v.is_conj() && !v.is_neg();
  }

  // Drop the cached views of sid's storage (a failed op may have left one changed).
  void forget(int64_t sid) {
    if (Entry* e = find(sid)) e->views.clear();
  }

  // Make sid name ``st`` (an op's fresh output); ``d``, ``t``: its descriptor and the tensor it names.
  void bind(int64_t sid, const c10::Storage& st, int64_t dev, const Desc* d = nullptr, const at::Tensor* t = nullptr) {
    Entry& e = enter(sid, st, dev);
    if (d != nullptr) e.views.push_back(View{d->code, d->offset, d->size, d->stride, *t});
  }

  // If sid still names the storage at ``ptr`` (memory a CUDA graph's replay is about to overwrite), move it
  // to a copy of its bytes; its cached views go with the old entry. Whether it did.
  bool evict(int64_t sid, int64_t ptr) {
    Entry* e = find(sid);
    if (e == nullptr || e->ptr != ptr || e->poison) return false;
    const c10::Storage old = e->storage;
    at::Tensor copy = at::empty({static_cast<int64_t>(old.nbytes())}, at::TensorOptions().dtype(at::kByte).device(old.device()));
    copy.copy_(bytes(old));
    bind(sid, copy.storage(), e->device);
    return true;
  }

  void poison(int64_t sid, int64_t dev, py::object cause) {
    free(sid);
    Entry& e = entries_[sid];
    e.device = dev;
    e.poison = std::move(cause);
  }

  void free(int64_t sid) {
    auto it = entries_.find(sid);
    if (it == entries_.end()) return;
    if (!it->second.poison) account(it->second.device, -static_cast<int64_t>(it->second.storage.nbytes()));
    entries_.erase(it);
  }

  // The storage address sid names, none when it names nothing or a failure (a CUDA graph's replay checks
  // that an input it captured is still the one the client names).
  std::optional<int64_t> address(int64_t sid) {
    Entry* e = find(sid);
    return e == nullptr || e->poison ? std::nullopt : std::optional<int64_t>(e->ptr);
  }

  // The frees of an events list when all its events are frees of an int id (the client's allocator log
  // between two ops: nearly always); false, nothing done, for anything else (apply_events does it).
  bool free_all(PyObject* events) {
    if (!PyList_CheckExact(events) || PyList_GET_SIZE(events) % 2) return false;
    const Py_ssize_t n = PyList_GET_SIZE(events);
    int64_t kind, sid;
    for (Py_ssize_t i = 0; i < n; i += 2)
      if (!as_int(PyList_GET_ITEM(events, i), kind) || kind != kEventFree || !PyLong_CheckExact(PyList_GET_ITEM(events, i + 1)) ||
          !as_int(PyList_GET_ITEM(events, i + 1), sid))
        return false;
    for (Py_ssize_t i = 0; i < n; i += 2) {
      as_int(PyList_GET_ITEM(events, i + 1), sid);
      free(sid);
    }
    return true;
  }

  // A message's allocator events in order: frees, and storages grown into new ids (COPY). A malformed
  // list fails as handles.py's apply_events fails on it (its index, hash and equality errors).
  void apply_events(PyObject* events) {
    if (free_all(events)) return;
    const Py_ssize_t n = PyObject_Length(events);
    if (n < 0) throw py::error_already_set();
    const py::int_ free_kind(kEventFree), copy_kind(kEventCopy);
    for (Py_ssize_t i = 0; i < n;) {
      py::object kind = steal(PySequence_GetItem(events, i));
      if (equal(kind, free_kind)) {
        py::object sid = steal(PySequence_GetItem(events, i + 1));
        if (PyObject_Hash(sid.ptr()) == -1) throw py::error_already_set();  // as a dict's pop says it
        int64_t id;
        if (as_int(sid.ptr(), id)) free(id);  // else it names nothing here
        i += 1 + RGPU_EVENT_FREE_FIELDS;
      } else if (equal(kind, copy_kind)) {
        int64_t f[RGPU_EVENT_COPY_FIELDS];
        bool src = true;  // a src id past 64 bits names nothing; a count past them takes every byte, as a slice does
        for (Py_ssize_t k = 0; k < RGPU_EVENT_COPY_FIELDS; ++k) {
          PyObject* v = i + 1 + k < n ? PySequence_GetItem(events, i + 1 + k) : nullptr;
          if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
          py::object held = py::reinterpret_steal<py::object>(v);
          int overflow = 0;
          if (v != nullptr && PyLong_Check(v)) f[k] = PyLong_AsLongLongAndOverflow(v, &overflow);
          if (v == nullptr || !PyLong_Check(v) || (overflow && k == 0))
            fail(PyExc_TypeError, "a COPY allocator event is 5 ints (dst, nbytes, device, src, count) of 64 bits");
          if (overflow) f[k] = overflow > 0 ? INT64_MAX : INT64_MIN;  // no such size or device: refused as such
          if (overflow && k == 3) src = false;
        }
        grow(f[0], f[1], f[2], src ? f[3] : f[0], f[4], src);
        i += 1 + RGPU_EVENT_COPY_FIELDS;
      } else {
        fail(PyExc_ValueError, "unknown allocator event " + py::str(kind).cast<std::string>());
      }
    }
  }

  // A storage grown on the client: ``dst`` (new, ``nbytes``) gets src's first ``count`` bytes; a failure
  // in src is dst's too.
  void grow(int64_t dst, int64_t nbytes, int64_t dev, int64_t src, int64_t count, bool has_src = true) {
    Entry* old = has_src ? find(src) : nullptr;
    if (old != nullptr && old->poison) {
      py::object cause = old->poison;
      poison(dst, dev, cause);
      return;
    }
    const c10::Storage from = old != nullptr ? old->storage : c10::Storage();
    Entry& fresh = entry(dst, nbytes, dev);
    if (old != nullptr) bytes(fresh.storage).slice(0, 0, count).copy_(bytes(from).slice(0, 0, count));
  }

  void close() {
    entries_.clear();
    allocated.assign(devices.size(), 0);
  }

 private:
  static bool equal(const py::object& a, const py::object& b) {
    const int r = PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ);
    if (r < 0) throw py::error_already_set();
    return r == 1;
  }

  static at::Tensor bytes(const c10::Storage& st) {
    return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(st.device())).set_(st);
  }

  // A storage first named by an op (its output, mostly): allocated as the tensor the descriptor names when
  // that is a contiguous tensor of exactly the storage's bytes, else as bytes and viewed.
  at::Tensor fresh(const Desc& d, std::optional<int64_t>& read) {
    const at::ScalarType dtype = dtype_of(d.code);
    int64_t n = 1;
    bool contiguous = d.offset == 0 && d.size.size() == d.stride.size();
    for (size_t i = d.size.size(); contiguous && i-- > 0;) {
      contiguous = d.stride[i] == n;
      n *= d.size[i];
    }
    if (contiguous && n * static_cast<int64_t>(c10::elementSize(dtype)) == d.nbytes) {
      at::Tensor t = at::empty(d.size, at::TensorOptions().dtype(dtype).device(device(d.dev)));
      bind(d.sid, t.storage(), d.dev, &d, &t);
      read = reinterpret_cast<int64_t>(t.storage().data_ptr().get());
      return t;
    }
    entry(d.sid, d.nbytes, d.dev);
    return view(d, read);
  }

  void cache(Entry& e, const Desc& d, const at::Tensor& t) {
    if (static_cast<int64_t>(e.views.size()) >= max_views_) e.views.clear();
    e.views.push_back(View{d.code, d.offset, d.size, d.stride, t});
  }

  // sid names ``st`` from now on (what it named before is freed), its bytes counted on ``dev``.
  Entry& enter(int64_t sid, const c10::Storage& st, int64_t dev) {
    free(sid);
    if (dev < 0 || dev >= static_cast<int64_t>(devices.size())) fail(PyExc_IndexError, "list index out of range");
    Entry& e = entries_[sid];
    e.storage = st;
    e.device = dev;
    e.ptr = reinterpret_cast<int64_t>(st.data_ptr().get());
    account(dev, static_cast<int64_t>(st.nbytes()));
    return e;
  }

  void account(int64_t dev, int64_t nbytes) {
    allocated[dev] += nbytes;
    if (allocated[dev] > peak[dev]) peak[dev] = allocated[dev];
  }

  std::unordered_map<int64_t, Entry> entries_;
  std::vector<std::optional<at::ScalarType>> dtypes_;
  int64_t max_views_;
};

// The bindings of HandleTable's Python face (handle_table.cpp), called from the module's init (fast_op.cpp).
void bind_handle_table(py::module_& m);

}  // namespace rgpu_server
