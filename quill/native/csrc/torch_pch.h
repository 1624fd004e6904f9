// The torch headers the binding TUs (build.py TORCH_SOURCES) include, precompiled once by the build
// (_build/torch_pch.h.gch) and force-included into each of them: parsing them was about 12 of each
// TU's ~33 CPU seconds.  Each TU still includes what it uses, so it also compiles without the PCH.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>
