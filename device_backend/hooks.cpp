// hooks.cpp: at::PrivateUse1HooksInterface for rgpu, with the device's generators (pinned memory: pinned.cpp).
//
// A generator here holds only a seed and an offset: the random state that ops
// use lives on the server, per session; Python reads these numbers when it
// sends a seed (torch.rgpu.manual_seed) or a generator argument.
#include "rgpu_device.h"

#include <ATen/ATen.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/GeneratorImpl.h>

#include <cstring>
#include <deque>
#include <mutex>

namespace rgpu {
namespace {

constexpr uint64_t kDefaultSeed = 67280421310721ULL;  // the CUDA generator's default

struct Generator final : c10::GeneratorImpl {
  explicit Generator(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}

  void set_current_seed(uint64_t seed) override { seed_ = seed; offset_ = 0; }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    set_current_seed(c10::detail::getNonDeterministicRandom(true));
    return seed_;
  }
  // State: 16 bytes, the seed then the offset (like the CUDA generator's layout idea).
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.numel() == 16 && state.dtype() == at::kByte, "rgpu generator state must be 16 bytes");
    const auto* bytes = static_cast<const uint8_t*>(state.data());
    std::memcpy(&seed_, bytes, 8);
    std::memcpy(&offset_, bytes + 8, 8);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto state = at::empty({16}, at::kByte);
    auto* bytes = state.data_ptr<uint8_t>();
    std::memcpy(bytes, &seed_, 8);
    std::memcpy(bytes + 8, &offset_, 8);
    return state.getIntrusivePtr();
  }

 private:
  Generator* clone_impl() const override {
    auto* copy = new Generator(device_.index());
    copy->seed_ = seed_;
    copy->offset_ = offset_;
    return copy;
  }
  uint64_t seed_ = kDefaultSeed;
  uint64_t offset_ = 0;
};

const at::Generator& default_generator(c10::DeviceIndex index) {
  static std::mutex mutex;
  static std::deque<at::Generator> generators;  // deque: references stay valid as it grows
  std::lock_guard<std::mutex> lock(mutex);
  if (index < 0) index = current_device();
  while (static_cast<c10::DeviceIndex>(generators.size()) <= index) {
    generators.push_back(at::make_generator<Generator>(static_cast<c10::DeviceIndex>(generators.size())));
  }
  return generators[index];
}

// Why no `override` on most members: the interface gains and loses virtuals
// between torch releases, and this file builds against 2.11 and 2.13 alike.
struct Hooks final : at::PrivateUse1HooksInterface {
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  bool isBuilt() const { return true; }
  bool isAvailable() const { return true; }
  c10::DeviceIndex deviceCount() const { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex d) const { set_current_device(d); }
  c10::DeviceIndex getCurrentDevice() const { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const {
    auto old = current_device();
    if (d >= 0) set_current_device(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const { return default_generator(index); }
  at::Generator getNewGenerator(c10::DeviceIndex index) const {
    return at::make_generator<Generator>(index < 0 ? current_device() : index);
  }
  at::Device getDeviceFromPtr(void*) const { return c10::Device(c10::DeviceType::PrivateUse1, current_device()); }
  bool isPinnedPtr(const void* ptr) const { return is_pinned(ptr); }
  at::Allocator* getPinnedMemoryAllocator() const { return pinned_allocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const {
    resize_bytes(storage.unsafeGetStorageImpl(), nbytes);
  }
};

struct Register {
  Register() { at::RegisterPrivateUse1HooksInterface(new Hooks()); }
} g_register;

}  // namespace
}  // namespace rgpu
