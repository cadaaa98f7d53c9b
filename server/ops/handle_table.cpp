// HandleTable's Python face (handle_table.h): handles.py's HandleTable's methods, for the server's Python.
//
// The Python op path, uploads, graphs, CUDA graph replays and the memory counts call these; the C++ op path
// (fast_op.cpp) calls the class itself. Errors are the ones handles.py's table raises: a poisoned id its
// Poisoned, an unknown dtype code or device by name, a geometry past the storage what as_strided says.
// ``entries`` (a dict of live entry faces) is for tests and debugging, not for the hot path.
#include "handle_table.h"

#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>

namespace rgpu_server {
namespace {

using Table = std::shared_ptr<HandleTable>;

// A descriptor from Python, else the error unpacking it in handles.py raises (or one that names the field).
Desc desc_of(py::handle o) {
  Desc d;
  if (d.parse(o.ptr())) return d;
  py::object seq = steal(PySequence_Fast(o.ptr(), "cannot unpack a tensor descriptor that is not a list"));
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  if (n != 7)
    fail(PyExc_ValueError, n < 7 ? "not enough values to unpack (expected 7, got " + std::to_string(n) + ")"
                                 : std::string("too many values to unpack (expected 7)"));
  PyObject* code = PySequence_Fast_ITEMS(seq.ptr())[2];
  if (!PyLong_CheckExact(code))
    fail(PyExc_ValueError, "unknown dtype code " + py::repr(code).cast<std::string>());
  py::list fields = steal(PySequence_List(seq.ptr()));
  for (int k : {3, 4}) {  // sizes and strides as any iterable of ints, as tuple() takes them
    PyObject* items = PySequence_List(fields[k].ptr());
    if (items == nullptr) throw py::error_already_set();
    fields[k] = steal(items);
  }
  if (d.parse(fields.ptr())) return d;
  fail(PyExc_TypeError, "a tensor descriptor is [id, nbytes, dtype code, sizes, strides, offset, device] of ints, "
                        "not " + py::repr(o).cast<std::string>().substr(0, 200));
}

bool id_of(py::handle sid, int64_t& out) { return as_int(sid.ptr(), out); }  // True is 1, as in a dict

int64_t id_or_raise(py::handle sid) {
  int64_t out;
  if (!id_of(sid, out)) fail(PyExc_TypeError, "a storage id is an int, not " + py::repr(sid).cast<std::string>());
  return out;
}

py::object wrap(const at::Tensor& t) { return steal(THPVariable_Wrap(t)); }

at::Tensor unwrap(py::handle v) {
  if (!THPVariable_Check(v.ptr())) fail(PyExc_TypeError, "expected a tensor");
  return THPVariable_Unpack(v.ptr());
}

void note(py::handle ptrs, const std::optional<int64_t>& read) {
  if (read && !ptrs.is_none() && PyList_Append(ptrs.ptr(), py::int_(*read).ptr()) < 0) throw py::error_already_set();
}

py::object tensor(HandleTable& t, py::handle desc, py::handle ptrs) {
  std::optional<int64_t> read;
  at::Tensor got = t.tensor(desc_of(desc), read);
  note(ptrs, read);
  return wrap(got);
}

py::object view(HandleTable& t, py::handle desc, py::handle ptrs) {
  std::optional<int64_t> read;
  at::Tensor got = t.view(desc_of(desc), read);
  note(ptrs, read);
  return wrap(got);
}

// view() of every item of a list of wire tensors ({"t": descriptor}: a _foreach_ op's list of ~100
// parameters); None if an item is anything else (the caller then decodes the list item by item).
py::object view_list(HandleTable& t, py::handle wire, py::handle ptrs) {
  py::object seq = steal(PySequence_Fast(wire.ptr(), "expected a list"));
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  py::list out(n);
  py::str tag(RGPU_TAG_TENSOR);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = PySequence_Fast_ITEMS(seq.ptr())[i];
    PyObject* desc = PyDict_CheckExact(x) && PyDict_GET_SIZE(x) == 1 ? PyDict_GetItem(x, tag.ptr()) : nullptr;
    if (desc == nullptr) return py::none();
    out[i] = view(t, desc, ptrs);
  }
  return std::move(out);
}

void bind(HandleTable& t, py::handle sid, py::handle storage, int64_t dev, py::handle with) {
  if (!THPStorage_Check(storage.ptr())) fail(PyExc_TypeError, "bind: expected an untyped storage");
  const c10::Storage st = THPStorage_Unpack(storage.ptr());
  if (with.is_none()) return t.bind(id_or_raise(sid), st, dev);
  py::tuple pair = py::reinterpret_borrow<py::object>(with);
  const Desc d = desc_of(pair[0]);
  const at::Tensor v = unwrap(pair[1]);
  t.bind(id_or_raise(sid), st, dev, &d, &v);
}

// One entry seen from Python (tests, debugging): live, it reads the table's entry for its id at each use.
struct EntryFace {
  Table table;
  int64_t sid;

  Entry& get() const {
    Entry* e = table->find(sid);
    if (e == nullptr) fail(PyExc_KeyError, std::to_string(sid) + " names no entry any more");
    return *e;
  }
};

// An entry's cached views, live: len, items() ((code, sizes, strides, offset) -> tensor), clear().
struct ViewsFace {
  EntryFace entry;
};

py::dict entries(const Table& t) {
  py::dict out;
  for (const auto& kv : t->entries()) out[py::int_(kv.first)] = EntryFace{t, kv.first};
  return out;
}

}  // namespace

void bind_handle_table(py::module_& m) {
  using py::arg;
  using torch::wrap_pybind_function;
  py::class_<ViewsFace>(m, "TableViews")
      .def("__len__", [](const ViewsFace& v) { return v.entry.get().views.size(); })
      .def("__bool__", [](const ViewsFace& v) { return !v.entry.get().views.empty(); })
      .def("clear", [](const ViewsFace& v) { v.entry.get().views.clear(); })
      .def("items", [](const ViewsFace& v) {
        py::list out;
        for (const View& x : v.entry.get().views) {
          py::tuple key = py::make_tuple(x.code, py::tuple(py::cast(std::vector<int64_t>(x.size.begin(), x.size.end()))),
                                         py::tuple(py::cast(std::vector<int64_t>(x.stride.begin(), x.stride.end()))), x.offset);
          out.append(py::make_tuple(key, wrap(x.t)));
        }
        return out;
      });
  py::class_<EntryFace>(m, "TableEntry")
      .def_property_readonly("storage", [](const EntryFace& f) -> py::object {
        const Entry& e = f.get();
        return e.poison ? py::none() : steal(THPStorage_Wrap(e.storage));
      })
      .def_property_readonly("device", [](const EntryFace& f) { return f.get().device; })
      .def_property_readonly("ptr", [](const EntryFace& f) { return f.get().ptr; })
      .def_property_readonly("poison", [](const EntryFace& f) -> py::object {
        const Entry& e = f.get();
        return e.poison ? e.poison : py::none();
      })
      .def_property_readonly("views", [](const EntryFace& f) { return ViewsFace{f}; })
      // handles.py's entries keep a flat tensor per dtype; this table makes views straight from the storage
      .def_property_readonly("flat", [](const EntryFace&) { return py::dict(); });

  // dynamic_attr: a diagnostic may wrap a method on the instance, as on handles.py's (tools/diag/)
  py::class_<HandleTable, Table>(m, "HandleTable", "One session's handle table (handle_table.h); handles.py's interface",
                                 py::dynamic_attr())
      .def(py::init([](py::sequence devices, py::sequence dtypes, int64_t max_views) {
             std::vector<c10::Device> devs;
             for (py::handle d : devices) {
               if (!THPDevice_Check(d.ptr())) fail(PyExc_TypeError, "devices: expected torch.device objects");
               devs.push_back(reinterpret_cast<THPDevice*>(d.ptr())->device);
             }
             std::vector<std::optional<at::ScalarType>> types;
             for (py::handle d : dtypes)
               types.push_back(THPDtype_Check(d.ptr()) ? std::optional<at::ScalarType>(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type)
                                                      : std::nullopt);
             return std::make_shared<HandleTable>(std::move(devs), std::move(types), max_views);
           }),
           arg("devices"), arg("dtypes"), arg("max_views"))
      .def_property_readonly("devices", [](const HandleTable& t) {
        py::list out;
        for (const c10::Device& d : t.devices) out.append(steal(THPDevice_New(d)));
        return out;
      })
      .def_property_readonly("allocated", [](const HandleTable& t) { return t.allocated; })
      .def_property_readonly("peak", [](const HandleTable& t) { return t.peak; })
      .def_property_readonly("max_bytes", [](const HandleTable&) { return py::none(); })  // no quota here
      .def_property_readonly("entries", [](const Table& t) { return entries(t); })
      .def("device", wrap_pybind_function([](HandleTable& t, int64_t index) { return steal(THPDevice_New(t.device(index))); }))
      .def("tensor", wrap_pybind_function([](HandleTable& t, py::handle desc, py::handle ptrs) { return tensor(t, desc, ptrs); }),
           arg("desc"), arg("ptrs") = py::none())
      .def("view", wrap_pybind_function([](HandleTable& t, py::handle desc, py::handle ptrs) { return view(t, desc, ptrs); }))
      .def("view_list", wrap_pybind_function([](HandleTable& t, py::handle wire, py::handle ptrs) { return view_list(t, wire, ptrs); }))
      .def("keep", wrap_pybind_function([](HandleTable& t, py::handle desc, py::handle v) { return t.keep(desc_of(desc), unwrap(v)); }))
      .def("forget", [](HandleTable& t, py::handle sid) {
        int64_t id;
        if (id_of(sid, id)) t.forget(id);
      })
      .def("bind", wrap_pybind_function([](HandleTable& t, py::handle sid, py::handle storage, int64_t dev, py::handle with) {
             bind(t, sid, storage, dev, with);
           }),
           arg("sid"), arg("storage"), arg("dev"), arg("view") = py::none())
      .def("evict", wrap_pybind_function([](HandleTable& t, py::handle sid, int64_t ptr) {
             int64_t id;
             return id_of(sid, id) && t.evict(id, ptr);
           }))
      .def("poison", [](HandleTable& t, py::handle sid, int64_t dev, py::object cause) { t.poison(id_or_raise(sid), dev, cause); })
      .def("free", [](HandleTable& t, py::handle sid) {
        int64_t id;
        if (id_of(sid, id)) t.free(id);
      })
      .def("address", [](HandleTable& t, py::handle sid) -> py::object {
        int64_t id;
        auto got = id_of(sid, id) ? t.address(id) : std::nullopt;
        return got ? py::object(py::int_(*got)) : py::object(py::none());
      })
      .def("apply_events", wrap_pybind_function([](HandleTable& t, py::handle events) { t.apply_events(events.ptr()); }))
      .def("free_all", wrap_pybind_function([](HandleTable& t, py::handle events) { return t.free_all(events.ptr()); }))
      .def("close", &HandleTable::close);
}

}  // namespace rgpu_server
