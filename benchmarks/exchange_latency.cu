// Per-step exchange latency of h between blocks, without products: global tagged words (the
// persistent kernel's "tagged" exchange, acquire or relaxed loads) against a thread block cluster
// (h pushed into every block's shared memory, then cluster.sync()). H = 512 floats a step.
// On a GPU machine (sm_90), from the repository root:
//   nvcc -O3 -arch=sm_90a -o exchange benchmarks/exchange_latency.cu && ./exchange
#include <cstdio>
#include <cstdint>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

__device__ __forceinline__ uint64_t ld_acquire(const uint64_t* p) {
  uint64_t v; asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p)); return v;
}
__device__ __forceinline__ uint64_t ld_relaxed(const uint64_t* p) {
  uint64_t v; asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p)); return v;
}

template <bool ACQ>
__global__ void __launch_bounds__(256) tagged(uint64_t* words, float* out, int H, int steps) {
  extern __shared__ float hs[];
  int per = H / gridDim.x;
  float acc = 0.f;
  for (int t = 0; t < steps; ++t) {
    // publish this block's slice of h_t (tag t + 1) into slot (t + 1) & 1
    if (threadIdx.x < per) {
      float v = hs[blockIdx.x * per + threadIdx.x] * 0.5f + 1.0f;
      uint64_t w = ((uint64_t)(t + 1) << 32) | __float_as_uint(v);
      *((volatile uint64_t*)&words[((t + 1) & 1) * H + blockIdx.x * per + threadIdx.x]) = w;
    }
    // stage every block's h_t
    for (int e = threadIdx.x; e < H; e += blockDim.x) {
      const uint64_t* p = &words[((t + 1) & 1) * H + e];
      uint64_t w = ACQ ? ld_acquire(p) : ld_relaxed(p);
      while ((w >> 32) != (uint64_t)(t + 1)) w = ACQ ? ld_acquire(p) : ld_relaxed(p);
      hs[e] = __uint_as_float((uint32_t)w);
    }
    __syncthreads();
    acc += hs[threadIdx.x % H];
    __syncthreads();
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

__global__ void __launch_bounds__(256) clustered(float* out, int H, int steps) {
  extern __shared__ float sm[];  // [2][H] staged h, double-buffered
  cg::cluster_group cluster = cg::this_cluster();
  int nb = cluster.num_blocks(), me = cluster.block_rank();
  int per = H / nb;
  float acc = 0.f;
  for (int t = 0; t < steps; ++t) {
    float* cur = sm + ((t + 1) & 1) * H;
    // push this block's slice of h_t into every block's buffer (DSMEM stores)
    for (int e = threadIdx.x; e < per * nb; e += blockDim.x) {
      int dst = e / per, k = e % per;
      float v = sm[(t & 1) * H + me * per + k] * 0.5f + 1.0f;
      float* remote = cluster.map_shared_rank(cur, dst);
      remote[me * per + k] = v;
    }
    cluster.sync();  // barrier.cluster.arrive.release + wait.acquire
    acc += cur[threadIdx.x % H];
  }
  out[(blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}

int main() {
  int H = 512, steps = 4000;
  uint64_t* words; float* out;
  cudaMalloc(&words, 2 * H * 8); cudaMalloc(&out, 1 << 22);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int blocks : {8, 16, 32, 64, 128}) {
    for (int acq = 1; acq >= 0; --acq) {
      float best = 1e9;
      for (int rep = 0; rep < 5; ++rep) {
        cudaMemset(words, 0, 2 * H * 8);
        cudaEventRecord(a);
        if (acq) tagged<true><<<blocks, 256, H * 4>>>(words, out, H, steps);
        else tagged<false><<<blocks, 256, H * 4>>>(words, out, H, steps);
        cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); if (ms < best) best = ms;
      }
      printf("tagged %s blocks %3d: %.3f us/step (%s)\n", acq ? "acquire" : "relaxed", blocks,
             best * 1e3 / steps, cudaGetErrorString(cudaGetLastError()));
    }
  }
  cudaFuncSetAttribute(clustered, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaFuncSetAttribute(clustered, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * H * 4);
  for (int cs : {2, 4, 8, 16}) {
    for (int clusters : {1, 4, 8}) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(cs * clusters); cfg.blockDim = dim3(256); cfg.dynamicSmemBytes = 2 * H * 4;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = cs; attr[0].val.clusterDim.y = 1; attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr; cfg.numAttrs = 1;
      float best = 1e9; cudaError_t err = cudaSuccess;
      for (int rep = 0; rep < 5; ++rep) {
        cudaEventRecord(a);
        err = cudaLaunchKernelEx(&cfg, clustered, out, H, steps);
        cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); if (ms < best) best = ms;
      }
      printf("cluster of %2d x %d clusters: %.3f us/step (%s / %s)\n", cs, clusters,
             best * 1e3 / steps, cudaGetErrorString(err), cudaGetErrorString(cudaGetLastError()));
    }
  }
  return 0;
}
