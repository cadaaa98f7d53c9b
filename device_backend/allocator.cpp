// allocator.cpp: c10::Allocator for PrivateUse1 whose pointers are remote storage ids.
//
// Allocation is a counter increment: nothing is sent, the server materialises a
// storage the first time an op names its id. Frees and storage growth become
// events that Python drains and sends in order with the next message.
#include "rgpu_device.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>

namespace rgpu {
namespace {

std::atomic<uint64_t> g_next_id{1};
std::mutex g_events_mutex;
std::vector<int64_t> g_events;  // flattened [kind, fields...] records

// Why a deleter that only records: tensors die on any thread (autograd workers,
// the garbage collector), where neither the GIL nor the connection may be held.
void free_id(void* ctx) {
  auto id = static_cast<int64_t>(reinterpret_cast<uintptr_t>(ctx));
  std::lock_guard<std::mutex> lock(g_events_mutex);
  g_events.push_back(kFree);
  g_events.push_back(id);
}

struct RemoteAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    auto device = current_device();
    if (nbytes == 0) {
      return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::PrivateUse1, device));
    }
    return data_ptr_for(g_next_id.fetch_add(1), device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_id; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    // Why refuse: bytes of the rgpu device live on the server; every copy goes
    // through the op stream (resize_bytes records its own event instead).
    TORCH_CHECK(false, "rgpu: storages cannot be copied byte-wise on the client");
  }
};

RemoteAllocator g_allocator;

}  // namespace

c10::Allocator* allocator() { return &g_allocator; }

uint64_t mint_ids(uint64_t n) { return g_next_id.fetch_add(n); }

c10::DataPtr data_ptr_for(uint64_t id, c10::DeviceIndex device) {
  void* ptr = reinterpret_cast<void*>(id << kIdShift);
  void* ctx = reinterpret_cast<void*>(static_cast<uintptr_t>(id));
  return c10::DataPtr(ptr, ctx, &free_id, c10::Device(c10::DeviceType::PrivateUse1, device));
}

void resize_bytes(c10::StorageImpl* storage, size_t nbytes) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  auto device = storage->device();
  c10::DeviceGuard guard(device);
  c10::DataPtr fresh = g_allocator.allocate(nbytes);
  uint64_t old_id = id_of(storage->data_ptr().get());
  size_t count = std::min(nbytes, storage->nbytes());
  if (old_id != 0 && nbytes != 0 && count != 0) {
    // Recorded before the old DataPtr dies below, so the server copies first and frees after.
    std::lock_guard<std::mutex> lock(g_events_mutex);
    g_events.insert(g_events.end(), {kCopy, static_cast<int64_t>(id_of(fresh.get())),
                                     static_cast<int64_t>(nbytes), device.index(),
                                     static_cast<int64_t>(old_id), static_cast<int64_t>(count)});
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(nbytes);
}

std::vector<int64_t> drain_events() {
  std::vector<int64_t> out;
  std::lock_guard<std::mutex> lock(g_events_mutex);
  out.swap(g_events);
  return out;
}

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

}  // namespace rgpu
