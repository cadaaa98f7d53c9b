// fast_path.h: what the fast path's two files share: an op's argument facts, its signature and wire form.
//
// fast_encode.cpp turns a boxed call into what encode.py would make of it (the
// signature that keys a plan, the msgpack of args and kwargs, Python objects for
// a miss); fast_path.cpp keeps the plans, replays them and posts; graph_call.cpp
// posts a shipped graph's calls the same way.
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

// bindings.cpp's describe(), packed.
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
void post_message(int kind, size_t fields, int64_t key, const std::string& body, size_t server = 0);

}  // namespace rgpu
