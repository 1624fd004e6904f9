// The ISA backend table: every entry point of one ISA variant (the quantized linear and its
// activation quantizers, the dense 16-bit linear, decode attention, KV stores, prefill attention,
// the Gated DeltaNet decode update),
// and the one place a variant is chosen.  Python decides the ISA once, at load, from the Platform
// (quill.native.isa_for: "avx512", "avx2" or "scalar") and hands that name to every native
// entry; each entry takes its functions from backend_for(name).  backends.cpp fills the table
// with the variants this build compiled (quill/native/build.py passes -DQUILL_BUILT_<ISA>),
// and a name this CPU cannot run, or that was not built, is an error, never an illegal
// instruction.  The CPU checks are the flag sets quill.native.ISAS requires.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "attention.h"
#include "common.h"
#include "deltanet.h"
#include "dense.h"
#include "mxfp4.h"
#include "prefill.h"

namespace quill {

struct IsaBackend {
  const char* name;            // "avx512", "avx2", "scalar"
  const KernelTable* linear;   // quantized linears and activation quantizers (common.h)
  DenseGemm dense;             // dense 16-bit linear (dense.h)
  AttnHead attn_head;          // decode attention, one (sequence, KV head) (attention.h)
  KVStore kv_store;            // k / v rows into a pool (attention.h)
  PrefillBlock prefill;        // prefill attention, one (KV head, query block) (prefill.h)
  DnConv dn_conv;              // Gated DeltaNet decode: conv step of a channel range (deltanet.h)
  DnHead dn_head;              // Gated DeltaNet decode: delta rule and gated norm of one value head
  const Mxfp4Kernels* mxfp4;   // MXFP4 linears, float and int8 activations (mxfp4.h)
};

// An ISA name that is unknown, not built into this extension, or not runnable on this CPU
// (raised in Python as quill.errors.KernelError).
struct IsaFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The backend of `isa`; else throws IsaFailure "<entry>: <why>" (names the ISA, what it needs,
// and what this build holds).
const IsaBackend& backend_for(const std::string& isa, const char* entry);

// The variants compiled into this extension, best first ("scalar" last, always there).
std::vector<std::string> built_isas();

}  // namespace quill
