// rgpu_device.h: what the C++ files of the rgpu PrivateUse1 device share.
//
// A storage on the rgpu device is a number minted here (a "storage id"); its
// data pointer is that id shifted left by kIdShift, never dereferenced on this
// machine. The server binds the id to real memory the first time an op names it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <vector>

#include "rgpu_protocol.h"  // rgpu/protocol: message kinds, events, value tags (generated)

namespace rgpu {

// Why 20 bits: every storage gets its own 1 MiB window of fake addresses, so a
// view's data_ptr (base + offset) rarely meets another storage's base; only
// base pointers have to be unique, and 44 bits of ids never run out.
constexpr int kIdShift = 20;

inline uint64_t id_of(const void* ptr) {
  return reinterpret_cast<uint64_t>(ptr) >> kIdShift;
}

// Events the Python side drains (in order) before it sends the next message.
enum EventKind : int64_t {
  kFree = RGPU_EVENT_FREE,  // [kFree, id]
  kCopy = RGPU_EVENT_COPY,  // [kCopy, dst_id, dst_nbytes, device, src_id, count]: storage grew
};

// allocator.cpp
c10::Allocator* allocator();
uint64_t mint_ids(uint64_t n);  // reserve n consecutive ids, return the first
c10::DataPtr data_ptr_for(uint64_t id, c10::DeviceIndex device);
void resize_bytes(c10::StorageImpl* storage, size_t nbytes);
std::vector<int64_t> drain_events();

// bindings.cpp: a tensor on src's storage with this geometry (views the fallback works out itself)
at::Tensor alias_of(const at::Tensor& src, at::ScalarType dtype, at::IntArrayRef size, at::IntArrayRef stride,
                    int64_t offset);

// pinned.cpp: host memory for pin_memory(); big blocks are memfds a same-host server can map
c10::Allocator* pinned_allocator();
bool is_pinned(const void* ptr);
std::vector<int64_t> pinned_region(uint64_t addr);  // [fd, base, size] of the memfd block holding addr, or []

// guard.cpp
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
c10::DeviceIndex device_count();
void set_device_count(c10::DeviceIndex count);

}  // namespace rgpu
