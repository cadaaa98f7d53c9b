// fast_path.h: what the fast path's files share: an op's argument facts, its signature and wire form.
//
// fast_encode.cpp turns a boxed call into what encode.py would make of it (the
// signature that keys a plan, the msgpack of args and kwargs, Python objects for
// a miss); fast_path.cpp keeps the plans, replays them and posts; fast_copies.cpp
// does small copies and ``.item()``; graph_call.cpp posts a shipped graph's calls the same way.
#pragma once

#include "msgpack.h"

#include <torch/extension.h>

#include <string>
#include <utility>
#include <vector>

namespace rgpu {

// How a schema argument travels: as msgpack-python would write its Python value,
// as {"d": code} (a dtype), or only when None (layouts, devices, generators...: Python's).
enum class Kind : uint8_t { kPlain, kDtype, kNoneOnly };

struct Arguments {  // an op's schema, as the encoders need it
  bool by_type = false;  // in-place op: float scalars key by type only (optable.OpInfo.by_type)
  size_t kwarg_only_start = 0;
  std::vector<Kind> kinds;
};

Arguments arguments_of(const c10::FunctionSchema& schema);

// Appends the call's signature to `sig`; false when Python must see the call (an
// unusual argument). `device` ends as the first device tensor's index (or -1).
bool signature(std::string& sig, const Arguments& a, c10::ArrayRef<c10::IValue> args, int& device);

// bindings.cpp: a tensor's descriptor (storage id, nbytes, dtype, sizes, strides, offset, device), as Python
// sees it; pack_descriptor (fast_encode.cpp): the same, packed.
py::tuple describe(const at::Tensor& t);
void pack_descriptor(Packer& p, const at::TensorBase& t);

// The call's args (a list) and kwargs (a map), as the Python fallback would receive and encode them.
void pack_arguments(Packer& p, const c10::FunctionSchema& schema, const Arguments& a, c10::ArrayRef<c10::IValue> args);

// The call as PyTorch's Python fallback would receive it, and its result back onto the stack.
std::pair<py::tuple, py::dict> to_python(const c10::FunctionSchema& schema, const Arguments& a,
                                         c10::ArrayRef<c10::IValue> args);
void push_result(const c10::FunctionSchema& schema, torch::jit::Stack* stack, py::handle out);

// fast_path.cpp: whether this session streams from C++, and a message posted as the fast path posts
// an op: under the session's lock, `[kind, events, key, ...body]` (`fields` counts them all), to the
// session's `server`-th server (in device order).
bool streaming();
// fn() from a destructor (a lock let go, a reply released): the error in flight, if any, survives it.
void call_keeping_error(py::handle fn);
void post_message(int kind, size_t fields, int64_t key, const std::string& body, size_t server = 0);
// `[kind, events, ...body]` (three fields) and `buffer` posted to the server of rgpu:device.
void post_buffer(int kind, const std::string& body, int device, py::handle buffer);
// `[Msg.DOWNLOAD, events, describe(t)]` through the connection's call, its reply landing in `into` (writable
// memory): the session's lock held until the request is written, so the messages drained before it go first and
// other threads post while this one waits; a lone call where nothing else is in flight (over shm, one C call).
// The Reply, or None where C++ does not download (several servers).
py::object call_download(const at::Tensor& t, py::handle into);

// fast_copies.cpp: aten::_copy_from and aten::_local_scalar_dense done here when nothing needs converting
// (kNo / false: nothing done, Python's turn); the biggest copy it does (RGPU_POST_COPY_BYTES).
enum class Copied { kNo, kUpload, kDownload };
Copied copy_fast(torch::jit::Stack* stack);
bool item_fast(torch::jit::Stack* stack);
void set_copy_bytes(size_t nbytes);

}  // namespace rgpu
