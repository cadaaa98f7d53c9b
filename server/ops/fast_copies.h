// The copies the op path in fast_op.cpp does whole: an upload (Msg.UPLOAD: a training step's batch) and a small
// download (Msg.DOWNLOAD of an .item(), a loss's .cpu()); anything else is the executor's Python (uploads.py).
//
// The upload, why in C++: in Python (Uploads.whole and its pinned ring, uploads.py) the step's first upload cost the GPU
// host several times the server's time it costs here, the GPU idle meanwhile, at every step's start
// (docs/perf/fast_path-history.md, run12). The bytes go into pinned memory from CUDA's caching host
// allocator and from there to the device on its current stream, after what came before; the block goes back
// to the allocator with an event and is reused once the copy has read it. On the CPU executor they are
// copied in place.
#pragma once

#include <ATen/core/CachingHostAllocator.h>

#include "handle_table.h"

#include <cstring>
#include <memory>

namespace rgpu_server {

// ``data`` into the contiguous tensor ``desc`` names, after the message's frees (``events``): true when
// done; false for the executor's Python (events that are not all frees, a poisoned, strided or
// malformed destination, a size that does not match), which then redoes it all (frees twice are none).
inline bool upload_whole(HandleTable& table, py::handle events, py::handle desc, py::handle data) {
  Py_buffer view;
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_C_CONTIGUOUS) < 0) {
    PyErr_Clear();
    return false;
  }
  std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> held(&view, PyBuffer_Release);
  const auto n = static_cast<size_t>(view.len);
  if (!table.free_all(events.ptr())) return false;
  at::Tensor dst;
  Desc d;
  if (!d.parse(desc.ptr())) return false;
  try {
    std::optional<int64_t> read;
    dst = table.view(d, read);
  } catch (const py::error_already_set&) {  // poisoned, or the table refused it: Python says which
    return false;
  } catch (const c10::Error&) {             // a geometry past the storage: likewise
    return false;
  }
  if (!dst.is_contiguous() || dst.nbytes() != n || dst.is_conj() || dst.is_neg()) return false;
  if (n == 0) return true;
  if (dst.device().is_cpu()) {
    std::memcpy(dst.data_ptr(), view.buf, n);
    return true;
  }
  at::HostAllocator* host = at::getHostAllocator(dst.device().type());
  c10::Storage block(c10::Storage::use_byte_size_t(), n, host->allocate(n), host, false);
  std::memcpy(block.mutable_data(), view.buf, n);  // out of the frame before it goes back
  at::Tensor src;
  strided_view(block, at::kByte, {static_cast<int64_t>(n)}, {1}, 0, src);
  py::gil_scoped_release no_gil;
  dst.view({-1}).view(at::kByte).copy_(src, /*non_blocking=*/true);  // CUDA records the block's event
  return true;
}

// The bytes of the tensor ``desc`` names, after the message's frees (``events``), as a new bytes object, when
// they are fewer than ``max_bytes``; None for the executor's Python (events that are not all frees, a poisoned or
// malformed descriptor, a bigger tensor: the kept pinned buffer's), which then redoes it all (frees twice are
// none). Why: a one-element read (``.item()``) waits on the server's answer, whose Python was most of it.
inline py::object download_small(HandleTable& table, py::handle events, py::handle desc, size_t max_bytes) {
  if (!table.free_all(events.ptr())) return py::none();
  Desc d;
  if (!d.parse(desc.ptr())) return py::none();
  at::Tensor src;
  try {
    std::optional<int64_t> read;
    src = table.tensor(d, read);  // as the Python face's tensor(): checked against its storage, its poison raised
  } catch (const py::error_already_set&) {  // poisoned, or the table refused it: Python says which
    return py::none();
  } catch (const c10::Error&) {
    return py::none();
  }
  const auto n = static_cast<size_t>(src.numel()) * src.element_size();
  if (n >= max_bytes || src.is_conj() || src.is_neg()) return py::none();
  PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n));
  if (raw == nullptr) throw py::error_already_set();
  auto out = py::reinterpret_steal<py::bytes>(raw);
  if (n == 0) return std::move(out);
  at::Tensor host = at::from_blob(PyBytes_AS_STRING(raw), src.sizes(), src.options().device(at::kCPU));
  py::gil_scoped_release no_gil;
  host.copy_(src);  // after what came before on its device's stream, waited for (a GPU's: by DMA to this memory)
  return std::move(out);
}

}  // namespace rgpu_server
