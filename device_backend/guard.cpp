// guard.cpp: c10::impl::DeviceGuardImplInterface for PrivateUse1 (current device, one stream).
//
// The device count is a number Python sets once it knows the server (deviceCount
// is noexcept and called from autograd threads, so it may not ask the network).
#include "rgpu_device.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace rgpu {
namespace {

thread_local c10::DeviceIndex t_current = 0;
// Why 1 before the server answers: the autograd engine sizes its per-device
// queues from this the first time any backward runs.
std::atomic<c10::DeviceIndex> g_count{1};
std::atomic<int> g_servers{1};  // servers whose devices these are (RGPU_SERVER=a,b): the message says which

constexpr auto kType = c10::DeviceType::PrivateUse1;

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }

  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kType, t_current); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "rgpu guard got a ", d.type(), " device");
    if (d.index() >= 0) set_current_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) t_current = d.index();
  }

  // One in-order stream per device: the server runs a session's ops in order.
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override { return g_count.load(); }

  // Events order nothing on a single in-order stream: recording and waiting are no-ops.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {}
  void block(void* event, const c10::Stream& stream) const override {}
  bool queryEvent(void* event) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex device_index) const noexcept override {}
  bool queryStream(const c10::Stream& stream) const override { return true; }
  void synchronizeStream(const c10::Stream& stream) const override {}
};

}  // namespace

c10::DeviceIndex current_device() { return t_current; }

void set_current_device(c10::DeviceIndex index) {
  int count = g_count.load();
  bool ok = index >= 0 && index < count;
  if (g_servers.load() > 1)  // servers.Servers.of's words
    TORCH_CHECK(ok, "rgpu:", static_cast<int>(index), " does not exist (the servers have ", count, " devices)");
  TORCH_CHECK(ok, "rgpu: device index ", static_cast<int>(index), " is out of range (the server has ", count, ")");
  t_current = index;
}

c10::DeviceIndex device_count() { return g_count.load(); }
void set_device_count(c10::DeviceIndex count) { g_count.store(count); }
void set_server_count(int servers) { g_servers.store(servers); }  // bindings.cpp

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

}  // namespace rgpu
