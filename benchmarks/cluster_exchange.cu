// How long a step's exchange of h takes among the blocks of a thread-block cluster, against
// tagged words in L2 (the persistent kernel's exchanges; planner: "A cluster a group").
// Each block of 256 threads puts 32 values into every block's shared memory each step and
// waits for the others' before the next; ns a step over 20000 steps. On the GPU machine:
//
//     nvcc -O3 -arch=sm_90a -o /tmp/cluster_exchange benchmarks/cluster_exchange.cu
//     /tmp/cluster_exchange
//
// (docs/benchmarks.md, eighty-first session). `cuobjdump -sass` of the binary shows the
// cluster barrier with release semantics as MEMBAR.ALL.GPU.
#include <cstdio>
#include <cuda_runtime.h>

constexpr int kThreads = 256, kPer = 32, kSteps = 20000;

__device__ __forceinline__ unsigned smem(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ unsigned remote(unsigned local, unsigned cta) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(cta));
  return r;
}

__device__ __forceinline__ void wait_phase(unsigned long long* bar, int parity) {
  unsigned done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 "
                 "p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(smem(bar)), "r"(parity) : "memory");
  } while (!done);
}

// kind 0: plain stores, cluster barrier (release / acquire); 1: the same, relaxed arrival (no
// order); 2: st.async counting bytes on the receiver's mbarrier, all threads wait; 3: the same,
// thread 0 waits; 4: plain stores, each block's remote mbarrier.arrive.release.cluster.
template <int kKind>
__global__ void __launch_bounds__(kThreads, 1) exchange(int steps, float* out) {
  __shared__ float hn[2][1024];
  __shared__ unsigned long long bar[2];
  unsigned rank, ctas;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(ctas));
  int tx = threadIdx.x;
  for (int i = tx; i < 2048; i += kThreads) (&hn[0][0])[i] = 0.f;
  if (tx == 0) {
    for (int s = 0; s < 2; ++s)
      asm volatile("mbarrier.init.shared.b64 [%0], %1;"
                   :: "r"(smem(&bar[s])), "r"(kKind == 4 ? ctas : 1u));
  }
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  asm volatile("barrier.cluster.arrive.relaxed;\nbarrier.cluster.wait;" ::: "memory");
  float acc = 0.f;
  for (int t = 0; t < steps; ++t) {
    int slot = (t + 1) & 1, parity = ((t - 1) >> 1) & 1;
    if (kKind >= 2 && t > 0) {
      if (kKind == 2) {
        wait_phase(&bar[t & 1], parity);
      } else {
        if (tx == 0) wait_phase(&bar[t & 1], parity);
        __syncthreads();
      }
    }
    if ((kKind == 2 || kKind == 3) && tx == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;"
                   :: "r"(smem(&bar[slot])), "r"(kPer * ctas * 4) : "memory");
    acc += hn[t & 1][(tx * 7) & 1023];
    __syncthreads();
    if (tx < kPer) {
      float v = acc * 0.5f + 1.f;
      unsigned at = smem(&hn[slot][rank * kPer + tx]);
      for (unsigned c = 0; c < ctas; ++c) {
        if (kKind == 2 || kKind == 3)
          asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
                       :: "r"(remote(at, c)), "f"(v), "r"(remote(smem(&bar[slot]), c)) : "memory");
        else
          asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote(at, c)), "f"(v) : "memory");
      }
    }
    if (kKind == 0) asm volatile("barrier.cluster.arrive;\nbarrier.cluster.wait;" ::: "memory");
    if (kKind == 1)
      asm volatile("barrier.cluster.arrive.relaxed;\nbarrier.cluster.wait;" ::: "memory");
    if (kKind >= 2) __syncthreads();
    if (kKind == 4 && tx < (int)ctas)
      asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];"
                   :: "r"(remote(smem(&bar[slot]), tx)) : "memory");
  }
  if (kKind >= 2 && steps > 0 && tx == 0) wait_phase(&bar[steps & 1], ((steps - 1) >> 1) & 1);
  __syncthreads();
  if (tx == 0) out[blockIdx.x] = acc;
}

// Tagged words in L2 among `blocks` blocks (all resident): step t's words carry t.
__global__ void __launch_bounds__(kThreads, 1) tagged(int steps, unsigned long long* words,
                                                     float* out, int blocks) {
  int tx = threadIdx.x;
  float acc = 0.f;
  for (int t = 0; t < steps; ++t) {
    for (int e = tx; e < blocks * kPer; e += kThreads) {
      unsigned long long w;
      do {
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];"
                     : "=l"(w) : "l"(words + (t & 1) * blocks * kPer + e));
      } while ((w >> 32) != (unsigned)t);
      acc += __uint_as_float((unsigned)w) * 1e-9f;
    }
    __syncthreads();
    if (tx < kPer) {
      unsigned long long w = ((unsigned long long)(t + 1) << 32) | __float_as_uint(acc + 1.f);
      asm volatile("st.release.gpu.global.u64 [%0], %1;"
                   :: "l"(words + ((t + 1) & 1) * blocks * kPer + blockIdx.x * kPer + tx),
                   "l"(w) : "memory");
    }
  }
  if (tx == 0) out[blockIdx.x] = acc;
}

template <int kKind>
float cluster_ns(int ctas, float* out) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas * 3);
  cfg.blockDim = dim3(kThreads);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = ctas;
  attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaLaunchKernelEx(&cfg, exchange<kKind>, 10, out);
  cudaEventRecord(a);
  cudaLaunchKernelEx(&cfg, exchange<kKind>, kSteps, out);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms;
  cudaEventElapsedTime(&ms, a, b);
  return ms * 1e6f / kSteps;
}

int main() {
  float* out;
  cudaMalloc(&out, 4096 * sizeof(float));
  const char* kinds[] = {"cluster barrier, release", "cluster barrier, relaxed (no order)",
                         "st.async, all threads wait", "st.async, thread 0 waits",
                         "remote mbarrier arrive, release"};
  for (int ctas : {2, 4, 6, 8}) {
    float ns[] = {cluster_ns<0>(ctas, out), cluster_ns<1>(ctas, out), cluster_ns<2>(ctas, out),
                  cluster_ns<3>(ctas, out), cluster_ns<4>(ctas, out)};
    for (int k = 0; k < 5; ++k) printf("%d blocks, %s: %.1f ns a step\n", ctas, kinds[k], ns[k]);
  }
  unsigned long long* words;
  cudaMalloc(&words, 2 * 16 * kPer * sizeof(unsigned long long));
  for (int blocks : {2, 4, 8, 16}) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    float ms = 0;
    for (int run = 0; run < 2; ++run) {  // a short run first
      int steps = run ? kSteps : 10;
      cudaMemset(words, 0, 2 * 16 * kPer * sizeof(unsigned long long));
      cudaMemset(words + blocks * kPer, 0xff, blocks * kPer * sizeof(unsigned long long));
      cudaEventRecord(a);
      tagged<<<blocks, kThreads>>>(steps, words, out, blocks);
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      cudaEventElapsedTime(&ms, a, b);
    }
    printf("%d blocks, tagged words in L2: %.1f ns a step\n", blocks, ms * 1e6f / kSteps);
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
