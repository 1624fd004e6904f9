// Long-lived memory on 2 MiB pages for packed weights (transparent huge pages, madvise mode).
//
// Streaming weights through 4 KiB pages costs a TLB walk every 4 KiB, which under
// virtualisation (nested paging) lowered the read bandwidth by a third on the development
// VM.  Blocks of 2 MiB or more get their own 2 MiB-aligned mapping; smaller ones (a
// small model's layers, scales) are carved from shared 32 MiB chunks so they get huge
// pages too.  A chunk is unmapped when its last block is released.  Only 2 MiB regions
// actually touched are backed, so the last, partly used chunk wastes at most one page.
#include <sys/mman.h>

#include <cstdint>
#include <memory>
#include <mutex>

#include "hugepage.h"

namespace quill {
namespace {

constexpr size_t kHuge = size_t(2) << 20, kPage = 4096, kChunk = size_t(32) << 20, kAlign = 64;

// An anonymous mapping of `size` bytes (a multiple of 4 KiB) starting on a 2 MiB boundary,
// advised to use huge pages; null when the address space is exhausted.
void* map_aligned(size_t size) {
  void* raw = mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw), start = (base + kHuge - 1) / kHuge * kHuge;
  if (start > base) munmap(raw, start - base);  // trim to exactly [start, start + size)
  const uintptr_t end = base + size + kHuge;
  if (end > start + size) munmap(reinterpret_cast<void*>(start + size), end - start - size);
  madvise(reinterpret_cast<void*>(start), size, MADV_HUGEPAGE);  // best effort
  return reinterpret_cast<void*>(start);
}

std::shared_ptr<void> owned_mapping(void* p, size_t size) {
  return std::shared_ptr<void>(p, [size](void* q) { munmap(q, size); });
}

struct Arena {
  std::mutex mu;
  std::shared_ptr<void> chunk;  // the chunk small blocks are carved from
  size_t used = 0;
};

Arena& arena() {
  static Arena a;  // the allocator's own state, like malloc's
  return a;
}

}  // namespace

HugeBlock huge_alloc(size_t nbytes) {
  if (nbytes >= kHuge) {
    const size_t size = (nbytes + kPage - 1) / kPage * kPage;
    void* p = map_aligned(size);
    return p ? HugeBlock{p, owned_mapping(p, size)} : HugeBlock{};
  }
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  const size_t need = (nbytes + kAlign - 1) / kAlign * kAlign;
  if (!a.chunk || a.used + need > kChunk) {
    void* p = map_aligned(kChunk);
    if (!p) return HugeBlock{};
    a.chunk = owned_mapping(p, kChunk);
    a.used = 0;
  }
  void* p = static_cast<char*>(a.chunk.get()) + a.used;
  a.used += need;
  return HugeBlock{p, a.chunk};
}

}  // namespace quill
