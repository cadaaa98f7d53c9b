// bindings.cpp: the few C++ helpers the Python side of the device calls (pybind11).
//
// describe() reads a tensor's storage id and geometry in one call, the
// operation the op stream does for every tensor argument; the rest mint ids,
// drain allocator events and build tensors the fallback cannot build in Python.
// The fast path's functions (fast_path.cpp) and shipped graphs' calls (graph_call.cpp) join the same module.
#include "fast_path.h"
#include "rgpu_device.h"

#include <torch/extension.h>

namespace rgpu {
namespace {

constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);

py::tuple as_tuple(at::IntArrayRef values) {
  py::tuple out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = py::int_(values[i]);
  return out;
}

int dtype_code(const at::Tensor& t) { return static_cast<int>(t.scalar_type()); }

at::Tensor with_storage(at::Storage storage, int dtype, at::IntArrayRef size, at::IntArrayRef stride,
                        int64_t offset) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), kKeys, c10::scalarTypeToTypeMeta(static_cast<at::ScalarType>(dtype)));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride, offset);
  return t;
}

at::Tensor alias(const at::Tensor& src, int dtype, std::vector<int64_t> size, std::vector<int64_t> stride,
                 int64_t offset) {
  return with_storage(src.storage(), dtype, size, stride, offset);
}

// A tensor on a storage whose id was reserved before the server made it (data-dependent outputs).
at::Tensor adopt(uint64_t id, size_t nbytes, int device, int dtype, std::vector<int64_t> size,
                 std::vector<int64_t> stride, int64_t offset) {
  auto data = nbytes ? data_ptr_for(id, device)
                     : c10::DataPtr(nullptr, c10::Device(c10::DeviceType::PrivateUse1, device));
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                       std::move(data), allocator(), true);
  return with_storage(at::Storage(std::move(storage)), dtype, size, stride, offset);
}

}  // namespace

// (storage id, storage nbytes, dtype code, sizes, strides, storage offset, device index):
// tuples all the way down, so a descriptor is both the wire form and a cache key.
py::tuple describe(const at::Tensor& t) {
  const auto& storage = t.storage();
  return py::make_tuple(id_of(storage.data()), storage.nbytes(), static_cast<int>(t.scalar_type()),
                        as_tuple(t.sizes()), as_tuple(t.strides()), t.storage_offset(), t.device().index());
}

// A new tensor on src's storage: views whose kernels the fallback works out itself.
at::Tensor alias_of(const at::Tensor& src, at::ScalarType dtype, at::IntArrayRef size, at::IntArrayRef stride,
                    int64_t offset) {
  return with_storage(src.storage(), static_cast<int>(dtype), size, stride, offset);
}

void set_server_count(int servers);  // guard.cpp: how many servers the devices are on (its message)
void bind_fast_path(py::module_& m);  // fast_path.cpp
void bind_graph_call(py::module_& m);  // graph_call.cpp

}  // namespace rgpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rgpu PrivateUse1 device: C++ helpers";
  m.def("describe", &rgpu::describe);
  m.def("dtype_code", &rgpu::dtype_code);
  m.def("alias", &rgpu::alias);
  m.def("adopt", &rgpu::adopt);
  m.def("mint_ids", &rgpu::mint_ids);
  m.def("drain_events", &rgpu::drain_events);
  m.def("device_count", []() { return static_cast<int>(rgpu::device_count()); });
  m.def("set_device_count", [](int n, int servers) {
    rgpu::set_device_count(static_cast<c10::DeviceIndex>(n));
    rgpu::set_server_count(servers);
  }, py::arg("count"), py::arg("servers") = 1);
  m.def("current_device", []() { return static_cast<int>(rgpu::current_device()); });
  m.def("set_device", [](int d) { rgpu::set_current_device(static_cast<c10::DeviceIndex>(d)); });
  m.def("pinned_region", &rgpu::pinned_region);
  m.def("id_shift", []() { return rgpu::kIdShift; });
  rgpu::bind_fast_path(m);
  rgpu::bind_graph_call(m);
}
