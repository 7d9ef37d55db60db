"""The Triton kernels of the GPU backends (`compile` and `int4` on CUDA), a module for each thing
they compute:

- `decode`: the fused decode layer, `TritonDecode` (five launches a layer), with its kernels for
  RMSNorm + q/k/v + rotary embedding and RMSNorm + gate/up, their launch shapes, and
  `cuda_gate_up` (a 4-bit bfloat16 gate/up in CUDA C, backends/q4_decode.cu, on the tensor cores);
- `batch`: the same step for several rows of the KV cache at once, `BatchDecode` (batched TTS
  steps), each row bit for bit what `TritonDecode` gives it alone, and `gemv_rows`;
- `mma`: the batched step with its projections on the tensor cores, `MMADecode` (the TTS runner's
  batched steps), each row independent of its batch but not bit for bit `TritonDecode`, and `mma_rows`;
- `attention`: single-query attention over the KV cache, split over programs;
- `matvec`: matrix-vector products with dense or 4-bit weights: the K loop that the decode kernels
  share, and `gemv` (o_proj and down_proj into the residual stream, the LLM's lm_head);
- `q4`: 4-bit prefill products: `q4_mm` on the tensor cores, dequantization for cuBLAS, `q4_linear`;
- `norm`: a one-row RMSNorm (the final norm of a step), and with a residual's addition before it;
- `token`: the batch-invariant token layer's element-wise kernels (rotary embedding with the K/V
  writes, SiLU * up), bit for bit the eager layer's;
- `embed`: the TTS step's input, its last codes' embeddings summed (or BOS), in one launch;
- `sampling`: the TTS step's choice of codes;
- `launches`: every kernel the launch sites ask to compile, recorded on meta tensors without a GPU
  (for tools/kernel_targets.py and `precompile`);
- `precompile`: a first command's kernels compiled side by side in a helper process while the model
  loads, into Triton's own cache;
- `common`: what they share: the `Weight` they take, programmatic dependent launch, split-K
  counting and merging, rounding to the model dtype.

Importers name the module they need (nothing is re-exported here). The package is imported only
when a CUDA runner is built (it needs Triton); under `TRITON_INTERPRET=1` the same kernels run on
the CPU, which is how tests/test_kernels.py and tests/test_int4_kernels.py check them without a
GPU (their `gpu` tests, and tests/test_gpu.py, run them compiled).
"""
