// Long-lived memory on 2 MiB pages for packed weights (hugepage.cpp).
#pragma once

#include <cstddef>
#include <memory>

namespace quill {

struct HugeBlock {
  void* ptr = nullptr;           // 64-byte aligned; null if no memory could be mapped
  std::shared_ptr<void> owner;   // keeps the mapping alive; release it to free the block
};

// `nbytes` of zeroed memory backed by transparent huge pages where the kernel allows.
HugeBlock huge_alloc(size_t nbytes);

}  // namespace quill
