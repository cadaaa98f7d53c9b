// pinned.cpp: pinned host memory for the rgpu device (x.pin_memory(), DataLoader(pin_memory=True)).
//
// Blocks of kSharedMin bytes or more live in sealed memfds (Linux), so that a
// same-host server can map them: the shm transport then sends an upload from
// such a block by naming it, with no copy, and the server's GPU reads it by DMA
// once registered, as CUDA reads pinned memory. Blocks are cached by size
// (powers of two, as CUDA's caching host allocator does) and never unmapped:
// a DataLoader pins a batch of the same size every step, and the server keeps
// its mapping and registration of each block. Smaller blocks, and every block
// where memfd is missing, are ordinary memory that only remembers it is pinned.
#include "rgpu_device.h"

#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <map>
#include <mutex>
#include <unordered_set>

#ifdef __linux__
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace rgpu {
namespace {

constexpr size_t kSharedMin = 1 << 20;

struct Block {
  size_t size;
  int fd;
  bool in_use;
};

std::mutex g_mutex;
std::unordered_set<const void*> g_small;                 // pinned blocks in ordinary memory
std::map<uintptr_t, Block> g_blocks;                     // memfd blocks by base address
std::multimap<size_t, uintptr_t> g_idle;                 // memfd blocks free for reuse, by size

size_t round_up_pow2(size_t n) {
  size_t p = kSharedMin;
  while (p < n) p <<= 1;
  return p;
}

// A new sealed memfd block of `size` bytes mapped here, or nullptr where that cannot be made.
void* map_block(size_t size) {
#ifdef __linux__
  int fd = memfd_create("rgpu-pinned", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return nullptr;
  // sealed against shrinking: the server refuses a segment that could shrink under its mapping
  if (ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    close(fd);
    return nullptr;
  }
  void* ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (ptr == MAP_FAILED) {
    close(fd);
    return nullptr;
  }
#ifdef MADV_HUGEPAGE
  if (size >= (2u << 20)) madvise(ptr, size, MADV_HUGEPAGE);  // fewer TLB misses copying, where shmem THP allows
#endif
  g_blocks[reinterpret_cast<uintptr_t>(ptr)] = Block{size, fd, true};
  return ptr;
#else
  (void)size;
  return nullptr;
#endif
}

void free_pinned(void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_blocks.find(reinterpret_cast<uintptr_t>(ptr));
  if (it != g_blocks.end()) {
    it->second.in_use = false;
    g_idle.emplace(it->second.size, it->first);
    return;
  }
  g_small.erase(ptr);
  c10::free_cpu(ptr);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    if (nbytes >= kSharedMin) {
      size_t size = round_up_pow2(nbytes);
      std::lock_guard<std::mutex> lock(g_mutex);
      auto idle = g_idle.find(size);
      if (idle != g_idle.end()) {
        ptr = reinterpret_cast<void*>(idle->second);
        g_blocks[idle->second].in_use = true;
        g_idle.erase(idle);
      } else {
        ptr = map_block(size);
      }
    }
    if (!ptr && nbytes) {
      ptr = c10::alloc_cpu(nbytes);
      std::lock_guard<std::mutex> lock(g_mutex);
      g_small.insert(ptr);
    }
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

PinnedAllocator g_allocator;

// The memfd block holding `addr` (any address inside it), or g_blocks.end().
std::map<uintptr_t, Block>::const_iterator block_of(uintptr_t addr) {
  auto it = g_blocks.upper_bound(addr);
  if (it == g_blocks.begin()) return g_blocks.end();
  --it;
  return addr < it->first + it->second.size ? it : g_blocks.end();
}

}  // namespace

c10::Allocator* pinned_allocator() { return &g_allocator; }

bool is_pinned(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_small.count(ptr) != 0 || block_of(reinterpret_cast<uintptr_t>(ptr)) != g_blocks.end();
}

std::vector<int64_t> pinned_region(uint64_t addr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = block_of(static_cast<uintptr_t>(addr));
  if (it == g_blocks.end()) return {};
  return {static_cast<int64_t>(it->second.fd), static_cast<int64_t>(it->first),
          static_cast<int64_t>(it->second.size)};
}

}  // namespace rgpu
