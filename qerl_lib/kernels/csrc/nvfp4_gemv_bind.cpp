// torch binding of the NVFP4 decode GEMM (nvfp4_gemv.cu). The Python wrapper
// (qerl_lib/kernels/nvfp4_gemv_cuda.py) validates shapes, dtypes and alignment and gives the errors
// users see; the checks here only keep a bad call from reading out of bounds.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <vector>

#include "nvfp4_gemv.h"

namespace {

void check_cuda(const torch::Tensor& t, const torch::Device& dev, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == dev, "nvfp4_gemv_cuda: ", name, " must be on ", dev);
}

int bias_kind(const torch::Tensor& b) {
  if (b.scalar_type() == torch::kFloat32) return 1;
  if (b.scalar_type() == torch::kBFloat16) return 2;
  if (b.scalar_type() == torch::kFloat16) return 3;
  TORCH_CHECK(false, "nvfp4_gemv_cuda: bias must be float32, bf16 or fp16");
  return 0;
}

// y [M, N] (x.dtype). x [M, K] (last dim contiguous); packed uint8 [N, K/2]; scale uint8 [N, K/16];
// gs float32 [1] or [N]; LoRA: A slices [r, K], B slices [n_i, r], sum n_i = N (x.dtype).
torch::Tensor gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor gs,
                   c10::optional<torch::Tensor> bias, std::vector<torch::Tensor> lora_a,
                   std::vector<torch::Tensor> lora_b, double lora_scale, c10::optional<torch::Tensor> lora_index,
                   int64_t lora_slot, int64_t wr, int64_t wk, bool aligned, bool pdl, bool repacked,
                   int64_t loop) {
  const auto dev = x.device();
  check_cuda(x, dev, "x");
  check_cuda(packed, dev, "packed");
  check_cuda(scale, dev, "scale");
  check_cuda(gs, dev, "global_scale");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "nvfp4_gemv_cuda: x must be [M, K], last dim contiguous");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat16,
              "nvfp4_gemv_cuda: x must be bf16 or fp16");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(M >= 1 && M <= 16 && K >= 16 && K % 16 == 0,
              "nvfp4_gemv_cuda: 1 <= M <= 16, K a positive multiple of 16");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 && packed.size(1) * 2 == K &&
                  packed.stride(1) == 1, "nvfp4_gemv_cuda: packed must be uint8 [N, K/2]");
  TORCH_CHECK(scale.scalar_type() == torch::kUInt8 && scale.dim() == 2 && scale.size(0) == N &&
                  scale.size(1) * 16 == K && scale.stride(1) == 1, "nvfp4_gemv_cuda: scale must be uint8 [N, K/16]");
  TORCH_CHECK(gs.scalar_type() == torch::kFloat32 && gs.is_contiguous() && (gs.numel() == 1 || gs.numel() == N),
              "nvfp4_gemv_cuda: global_scale must be float32 [1] or [N]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % 8 == 0,
              "nvfp4_gemv_cuda: x rows must be 16-byte aligned");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 8 == 0 && packed.stride(0) % 8 == 0,
              "nvfp4_gemv_cuda: packed rows must be 8-byte aligned");
  if (aligned) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 16 == 0 && packed.stride(0) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(scale.data_ptr()) % 2 == 0 && scale.stride(0) % 2 == 0,
                "nvfp4_gemv_cuda: aligned=True needs 16-byte code rows and 2-byte scale rows");
  }
  const c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto y = torch::empty({M, N}, x.options());

  qg::Params p = {};
  p.codes = packed.data_ptr<uint8_t>();
  p.scales = scale.data_ptr<uint8_t>();
  p.gs = gs.data_ptr<float>();
  p.gs_stride = gs.numel() > 1 ? 1 : 0;
  if (bias.has_value() && bias->defined()) {
    check_cuda(*bias, dev, "bias");
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "nvfp4_gemv_cuda: bias must be contiguous [N]");
    p.bias = bias->data_ptr();
    p.bias_kind = bias_kind(*bias);
  }
  p.x = x.data_ptr();
  p.y = y.data_ptr();
  p.code_stride = packed.stride(0);
  p.scale_stride = scale.stride(0);
  p.x_stride = x.stride(0);
  p.y_stride = y.stride(0);
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.wr = static_cast<int>(wr);
  p.wk = static_cast<int>(wk);
  p.off1 = p.off2 = p.N;
  p.wait_x = pdl && lora_a.empty() ? 1 : 0;
  p.repacked = repacked ? 1 : 0;
  TORCH_CHECK(loop >= qg::kRounds && loop <= qg::kPipe2, "nvfp4_gemv_cuda: loop must be 0..3, got ", loop);
  p.loop = repacked ? static_cast<int>(loop) : qg::kRounds;

  const size_t slices = lora_a.size();
  torch::Tensor t;
  if (slices) {
    TORCH_CHECK(slices == lora_b.size() && slices <= qg::kMaxSlices, "nvfp4_gemv_cuda: 1 to 3 (A, B) slices");
    const int64_t rank = lora_a[0].size(0);
    int64_t rows = 0;
    for (size_t i = 0; i < slices; ++i) {
      const auto& a = lora_a[i];
      const auto& b = lora_b[i];
      check_cuda(a, dev, "lora_a");
      check_cuda(b, dev, "lora_b");
      TORCH_CHECK(a.dim() == 2 && a.size(0) == rank && a.size(1) == K && a.stride(1) == 1 &&
                      a.scalar_type() == x.scalar_type() && a.stride(0) % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0,
                  "nvfp4_gemv_cuda: LoRA A slices must be [r, K] in x.dtype, rows 16-byte aligned");
      TORCH_CHECK(b.dim() == 2 && b.size(1) == rank && b.stride(1) == 1 && b.scalar_type() == x.scalar_type(),
                  "nvfp4_gemv_cuda: LoRA B slices must be [n_i, r] in x.dtype");
      if (i == 1) p.off1 = static_cast<int>(rows);
      if (i == 2) p.off2 = static_cast<int>(rows);
      rows += b.size(0);
    }
    TORCH_CHECK(rows == N, "nvfp4_gemv_cuda: LoRA B slices cover ", rows, " rows, W has ", N);
    TORCH_CHECK(rank >= 1 && rank <= qg::kMaxRank, "nvfp4_gemv_cuda: LoRA rank must be 1..", qg::kMaxRank);
    const int64_t ks = (K + qg::kShrinkK - 1) / qg::kShrinkK;
    const int64_t kslice = ((K + ks - 1) / ks + 7) / 8 * 8;
    const int64_t ks_used = (K + kslice - 1) / kslice;
    t = torch::empty({ks_used, M, static_cast<int64_t>(slices) * rank}, x.options().dtype(torch::kFloat32));
    qg::ShrinkParams s = {};
    s.x = x.data_ptr();
    s.x_stride = x.stride(0);
    s.a0 = lora_a[0].data_ptr();
    s.sa0 = lora_a[0].stride(0);
    s.a1 = lora_a[slices > 1 ? 1 : 0].data_ptr();
    s.sa1 = lora_a[slices > 1 ? 1 : 0].stride(0);
    s.a2 = lora_a[slices > 2 ? 2 : 0].data_ptr();
    s.sa2 = lora_a[slices > 2 ? 2 : 0].stride(0);
    if (lora_index.has_value() && lora_index->defined()) {
      const auto& idx = *lora_index;
      check_cuda(idx, dev, "lora_index");
      TORCH_CHECK(idx.numel() >= M && idx.is_contiguous() &&
                      (idx.scalar_type() == torch::kInt32 || idx.scalar_type() == torch::kInt64),
                  "nvfp4_gemv_cuda: lora_index must be contiguous int32/int64 with >= M entries");
      s.index = idx.data_ptr();
      s.index_kind = idx.scalar_type() == torch::kInt32 ? 1 : 2;
    }
    s.t = t.data_ptr<float>();
    s.M = p.M;
    s.K = p.K;
    s.rank = static_cast<int>(rank);
    s.t_stride = static_cast<int>(slices * rank);
    s.slot = static_cast<int>(lora_slot);
    s.scale = static_cast<float>(lora_scale);
    s.kslice = static_cast<int>(kslice);
    const int err = qg::launch_lora_shrink(s, bf16, static_cast<int>(slices), stream.stream());
    TORCH_CHECK(err == 0, "nvfp4_gemv_cuda: LoRA shrink launch failed: ",
                cudaGetErrorString(static_cast<cudaError_t>(err)));
    p.t = s.t;
    p.t_stride = s.t_stride;
    p.rank = s.rank;
    p.ks = static_cast<int>(ks_used);
    p.lb0 = lora_b[0].data_ptr();
    p.sb0 = lora_b[0].stride(0);
    p.lb1 = lora_b[slices > 1 ? 1 : 0].data_ptr();
    p.sb1 = lora_b[slices > 1 ? 1 : 0].stride(0);
    p.lb2 = lora_b[slices > 2 ? 2 : 0].data_ptr();
    p.sb2 = lora_b[slices > 2 ? 2 : 0].stride(0);
  }
  const int err = qg::launch_gemv(p, bf16, aligned, pdl, stream.stream());
  TORCH_CHECK(err == 0, "nvfp4_gemv_cuda: launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
  return y;
}

int64_t kernel_regs(bool bf16, int64_t mt, bool aligned, bool repacked, int64_t loop) {
  return qg::gemv_kernel_regs(bf16, static_cast<int>(mt), aligned, repacked, repacked ? static_cast<int>(loop) : 0);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "NVFP4 W4A16 decode GEMM (1..16 rows), LoRA shrink + expand", py::arg("x"),
        py::arg("packed"), py::arg("scale"), py::arg("global_scale"), py::arg("bias"), py::arg("lora_a"),
        py::arg("lora_b"), py::arg("lora_scale"), py::arg("lora_index"), py::arg("lora_slot"), py::arg("wr"),
        py::arg("wk"), py::arg("aligned"), py::arg("pdl"), py::arg("repacked") = false, py::arg("loop") = 0);
  m.def("kernel_regs", &kernel_regs, "registers per thread of the GEMV kernel (bf16, mt, aligned, repacked, loop)",
        py::arg("bf16"), py::arg("mt"), py::arg("aligned"), py::arg("repacked") = false, py::arg("loop") = 0);
}
