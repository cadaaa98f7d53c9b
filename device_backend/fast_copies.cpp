// fast_copies.cpp: the copies the fast path does itself, as copies.py would do them, when nothing needs
// converting (dtype, shape, math bits, layout) and the bytes are few (RGPU_POST_COPY_BYTES):
//
// - an upload (``x.to("rgpu")`` of a batch): [Msg.UPLOAD, events, dst] and the bytes, posted, one frame
//   (the step's first message; its Python path was the start's costliest piece, fast_path-history.md run11);
// - a download (``.cpu()``) and a one-element read (``.item()``): [Msg.DOWNLOAD, events, src] through the
//   connection's call, the reply's bytes landing straight in the CPU tensor's memory (or a local for .item()):
//   one round trip with no Python fallback around it, a lone call (no future) where nothing else is in flight.
//   The session's lock is held until the request is written, as transfers.download holds it for its
//   request, so other threads post while this one waits.
//
// Anything else (conversions, big or pinned buffers, which shm may name, several servers) is Python's.
#include "fast_path.h"
#include "rgpu_device.h"

#include <c10/core/Scalar.h>

#include <cstring>

namespace rgpu {
namespace {

constexpr int kMsgUpload = RGPU_MSG_UPLOAD;
size_t g_copy_max = 0;  // RGPU_POST_COPY_BYTES: an upload this small is copied at the post; a download up to it here

// Strided, no conjugate or negative bit, not quantized: its memory holds its values as they are.
bool plain(const at::Tensor& t) {
  return t.layout() == at::kStrided && !t.is_conj() && !t.is_neg() && !at::isQIntType(t.scalar_type());
}

// A writable (or read-only) memoryview on `nbytes` at `ptr`: what the connection reads into or sends.
py::object memory(const void* ptr, size_t nbytes, int flags) {
  auto view = py::reinterpret_steal<py::object>(PyMemoryView_FromMemory(
      static_cast<char*>(const_cast<void*>(ptr)), static_cast<Py_ssize_t>(nbytes), flags));
  if (!view) throw py::error_already_set();
  return view;
}

// src's bytes from its server into `into` (`nbytes`, its exact size); false: C++ does not download here.
bool read_into(const at::Tensor& src, void* into, size_t nbytes) {
  py::object reply = call_download(src, memory(into, nbytes, PyBUF_WRITE));  // RemoteError, SessionLost...: the caller's
  if (reply.is_none()) return false;
  struct Release {  // the reply's leased buffers go back however this ends
    py::object fn;
    ~Release() { call_keeping_error(fn); }
  } release{reply.attr("release")};
  py::object buffers = reply.attr("buffers");
  py::object first = buffers[py::int_(0)];
  py::buffer_info info = py::reinterpret_borrow<py::buffer>(first).request();
  size_t n = static_cast<size_t>(info.size * info.itemsize);
  if (n != nbytes)
    throw std::runtime_error("rgpu: expected " + std::to_string(nbytes) + " bytes from the server, got " +
                             std::to_string(n));
  if (info.ptr != into) std::memcpy(into, info.ptr, nbytes);  // a reply that did not land in place
  return true;
}

bool upload(const at::Tensor& src, const at::Tensor& dst) {
  if (!src.is_contiguous() || dst.numel() == 0 || src.nbytes() > g_copy_max) return false;
  Packer p;
  pack_descriptor(p, dst);
  post_buffer(kMsgUpload, p.out, dst.device().index(), memory(src.const_data_ptr(), src.nbytes(), PyBUF_READ));
  return true;
}

bool download(const at::Tensor& src, const at::Tensor& dst) {
  // one element: its memory is at its data pointer whatever its stride
  if (!(dst.is_contiguous() || dst.numel() == 1) || src.numel() == 0 || dst.nbytes() > g_copy_max) return false;
  return read_into(src, dst.data_ptr(), dst.nbytes());
}

// The value of one element of `dtype` held in `bytes`, as the CPU's _local_scalar_dense makes it.
template <typename T>
c10::Scalar scalar_of(const unsigned char* bytes) {
  T v;
  std::memcpy(&v, bytes, sizeof(T));
  return c10::Scalar(v);
}

using ScalarOf = c10::Scalar (*)(const unsigned char*);

ScalarOf reader_for(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return &scalar_of<float>;
    case at::kDouble: return &scalar_of<double>;
    case at::kHalf: return &scalar_of<c10::Half>;
    case at::kBFloat16: return &scalar_of<c10::BFloat16>;
    case at::kByte: return &scalar_of<uint8_t>;
    case at::kChar: return &scalar_of<int8_t>;
    case at::kShort: return &scalar_of<int16_t>;
    case at::kInt: return &scalar_of<int32_t>;
    case at::kLong: return &scalar_of<int64_t>;
    case at::kBool: return &scalar_of<bool>;
    case at::kComplexFloat: return &scalar_of<c10::complex<float>>;
    case at::kComplexDouble: return &scalar_of<c10::complex<double>>;
    default: return nullptr;  // the rarer types (float8s, unsigned 16-64, complex half): Python's
  }
}

}  // namespace

void set_copy_bytes(size_t nbytes) { g_copy_max = nbytes; }

// aten::_copy_from(src, dst, non_blocking): an upload or a download when nothing needs converting.
Copied copy_fast(torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 3);
  if (!args[0].isTensor() || !args[1].isTensor()) return Copied::kNo;
  const at::Tensor& src = args[0].toTensor();
  const at::Tensor& dst = args[1].toTensor();
  if (!plain(src) || !plain(dst) || src.scalar_type() != dst.scalar_type() || src.sizes() != dst.sizes())
    return Copied::kNo;
  auto from = src.device().type(), to = dst.device().type();
  Copied done = Copied::kNo;
  if (from == c10::DeviceType::CPU && to == c10::DeviceType::PrivateUse1 && upload(src, dst))
    done = Copied::kUpload;
  else if (from == c10::DeviceType::PrivateUse1 && to == c10::DeviceType::CPU && download(src, dst))
    done = Copied::kDownload;
  if (done == Copied::kNo) return done;
  at::Tensor out = dst;
  torch::jit::drop(*stack, 3);
  stack->emplace_back(std::move(out));
  return done;
}

// aten::_local_scalar_dense(self): .item() of a one-element device tensor, its bytes read into a local.
bool item_fast(torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 1);
  if (!args[0].isTensor()) return false;
  const at::Tensor& src = args[0].toTensor();
  if (src.device().type() != c10::DeviceType::PrivateUse1 || !plain(src) || src.numel() != 1) return false;
  ScalarOf reader = reader_for(src.scalar_type());
  alignas(16) unsigned char bytes[16];
  size_t n = src.element_size();
  if (reader == nullptr || n > sizeof(bytes) || !read_into(src, bytes, n)) return false;
  c10::Scalar value = reader(bytes);
  torch::jit::drop(*stack, 1);
  stack->emplace_back(value);
  return true;
}

}  // namespace rgpu
