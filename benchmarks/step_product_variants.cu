// One step's float32 product out[n,o] = sum_k h[n,k] W[o,k] + b[o] at small batch (N 4-16,
// W of 24-256 MiB, read once a step from HBM), the structures of cuda.small_batch_gemv's kernel
// beside variants, each checked against float64 and timed with CUDA events (median of 15 runs
// of 50 launches). Run on a GPU machine from the repository root:
//
//     nvcc -O3 -arch=sm_90 -o /tmp/step_products benchmarks/step_product_variants.cu
//     /tmp/step_products
//
// base: a warp RW rows, its lanes 4 of each 128 of K, W loaded past L1 (the rule's
// STREAM_LOAD), h through L1, 4 or 8 warps a block. pre: W prefetched D chunks ahead in
// registers. splitk: K in S slices, a block's slice of h staged in
// shared memory once, the S partial sums added after (as rnncc's cell adds a product's parts).
// H200, 2026-11-29 (us; base 4 warps / pre D2 / pre D3 RW/2): 16 2048 6144 24.1 / 23.8 / 35.2;
// 16 2048 8192 27.0 / 35.5 / 40.3; 8 2048 8192 24.6 / 23.3 / 27.8; 16 4096 16384 90.1 / 109.3 /
// 167.1; 4 2048 8192 19.8 (3.4 TB/s) / 20.4 / 20.6. The bandwidth falls with N (3.4 TB/s at 4,
// 2.1-2.5 at 16): at N 16 every warp reads all of h (128 KiB) through L1, 196 MB a step for RW 4
// at O 6144, more than L1 keeps beside W; splitk (not yet run) reads h once a block.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do{cudaError_t e=(x); if(e!=cudaSuccess){printf("ERR %s line %d\n",cudaGetErrorString(e),__LINE__); exit(1);} }while(0)

__device__ __forceinline__ float4 ldg_na(const float* p){
  float4 v; asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x),"=f"(v.y),"=f"(v.z),"=f"(v.w) : "l"(p)); return v; }

template<int N, int RW>
__device__ __forceinline__ void zero(float (&acc)[RW][N]){
#pragma unroll
  for(int r=0;r<RW;++r)
#pragma unroll
  for(int n=0;n<N;++n) acc[r][n]=0.f;
}

// out[n*O + row0 + r]: the warp's sums of acc[r][n], plus b[row0 + r] (none where b is null)
template<int N, int RW>
__device__ __forceinline__ void reduce_store(float (&acc)[RW][N], const float* b, float* out, int row0, int O){
  int lane = threadIdx.x;
#pragma unroll
  for (int r=0;r<RW;++r)
#pragma unroll
  for (int n=0;n<N;++n){ float v=acc[r][n];
#pragma unroll
    for(int off=16;off;off>>=1) v+=__shfl_xor_sync(0xffffffff,v,off);
    if(lane==0) out[n*O+row0+r]=v+(b?b[row0+r]:0.f); }
}

// W loaded past L1 (cuda.small_batch_gemv's STREAM_LOAD), h through L1
template<int N, int RW>
__global__ void __launch_bounds__(256) base(const float* __restrict__ h, const float* __restrict__ W, const float* __restrict__ b, float* out, int K, int O){
  int lane=threadIdx.x; int row0=(blockIdx.x*blockDim.y+threadIdx.y)*RW;
  float acc[RW][N]; zero<N,RW>(acc);
  for(int c=0;c<K/128;++c){ int k=(c*32+lane)*4; float4 w[RW];
#pragma unroll
    for(int r=0;r<RW;++r) w[r]=ldg_na(W+(size_t)(row0+r)*K+k);
#pragma unroll
    for(int n=0;n<N;++n){ float4 x=__ldg((const float4*)(h+n*K+k));
#pragma unroll
      for(int r=0;r<RW;++r) acc[r][n]+=w[r].x*x.x+w[r].y*x.y+w[r].z*x.z+w[r].w*x.w; } }
  reduce_store<N,RW>(acc,b,out,row0,O);
}

// W prefetched D chunks ahead into registers (ring of D+1 register sets), loaded past L1
template<int N, int RW, int D>
__global__ void __launch_bounds__(128) pre(const float* __restrict__ h, const float* __restrict__ W, const float* __restrict__ b, float* out, int K, int O){
  int lane=threadIdx.x; int row0=(blockIdx.x*blockDim.y+threadIdx.y)*RW;
  float acc[RW][N]; zero<N,RW>(acc);
  const float* wr = W+(size_t)row0*K + lane*4;
  int chunks=K/128;
  float4 w[D+1][RW];
#pragma unroll
  for(int d=0;d<D;++d)
#pragma unroll
    for(int r=0;r<RW;++r) w[d][r] = ldg_na(wr+(size_t)r*K+d*128);
  for(int c=0;c<chunks;c+=D+1){
#pragma unroll
    for(int s=0;s<=D;++s){
      int cc=c+s; if(cc>=chunks) break;
      int nxt=cc+D;
      if(nxt<chunks){
#pragma unroll
        for(int r=0;r<RW;++r) w[(s+D)%(D+1)][r] = ldg_na(wr+(size_t)r*K+nxt*128);
      }
      int k=(cc*32+lane)*4;
#pragma unroll
      for(int n=0;n<N;++n){ float4 x=__ldg((const float4*)(h+n*K+k));
#pragma unroll
        for(int r=0;r<RW;++r) acc[r][n]+=w[s][r].x*x.x+w[s][r].y*x.y+w[s][r].z*x.z+w[s][r].w*x.w; }
    }
  }
  reduce_store<N,RW>(acc,b,out,row0,O);
}

// K in S slices: a block (a group of rows, slice s) stages its slice of h [N x K/S] in shared
// memory once and its warps stream their rows of W past L1 over the slice; the S partial sums
// part[s][n][o] (slice 0 with the bias) are added by the reader (rnncc's cell: gemm_parts)
template<int N, int RW, int S>
__global__ void __launch_bounds__(256) splitk(const float* __restrict__ h, const float* __restrict__ W, const float* __restrict__ b, float* part, int K, int O){
  extern __shared__ float4 hs[];
  int KS=K/S, s=blockIdx.y, lane=threadIdx.x, warp=threadIdx.y, warps=blockDim.y;
  int row0=(blockIdx.x*warps+warp)*RW;
  for(int i=warp*32+lane;i<N*KS/4;i+=warps*32){ int n=i/(KS/4), kk=i%(KS/4); hs[i]=__ldg((const float4*)(h+(size_t)n*K+s*KS)+kk); }
  __syncthreads();
  float acc[RW][N]; zero<N,RW>(acc);
  const float* wr=W+(size_t)row0*K+s*KS+lane*4;
  for(int c=0;c<KS/128;++c){ float4 w[RW];
#pragma unroll
    for(int r=0;r<RW;++r) w[r]=ldg_na(wr+(size_t)r*K+c*128);
#pragma unroll
    for(int n=0;n<N;++n){ float4 x=hs[(n*KS)/4+c*32+lane];
#pragma unroll
      for(int r=0;r<RW;++r) acc[r][n]+=w[r].x*x.x+w[r].y*x.y+w[r].z*x.z+w[r].w*x.w; } }
  reduce_store<N,RW>(acc,s==0?b:nullptr,part+(size_t)s*N*O,row0,O);
}
template<int S>
__global__ void sum_parts(const float* part, float* out, int NO){
  int i=blockIdx.x*blockDim.x+threadIdx.x; if(i>=NO) return; float v=0.f;
#pragma unroll
  for(int s=0;s<S;++s) v+=part[(size_t)s*NO+i];
  out[i]=v; }

template<typename F> float timeit(F f){ cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b); std::vector<float> t;
  for(int i=0;i<5;++i) f();
  for(int rep=0;rep<15;++rep){ cudaEventRecord(a); for(int i=0;i<50;++i) f(); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms,a,b); t.push_back(ms*1000/50);} 
  std::sort(t.begin(),t.end()); CK(cudaGetLastError()); return t[t.size()/2]; }

template<int N> void shape(int K, int O){
  size_t nh=(size_t)N*K, nw=(size_t)O*K; std::vector<float> H(nh),Wt(nw),B(O),R((size_t)N*O),Out((size_t)N*O);
  srand(1); for(auto&x:H)x=rand()/(float)RAND_MAX-0.5f; for(auto&x:Wt)x=(rand()/(float)RAND_MAX-0.5f)*0.05f; for(auto&x:B)x=rand()/(float)RAND_MAX;
  for(int n=0;n<N;++n) for(int o=0;o<O;++o){ double s=B[o]; for(int k=0;k<K;++k) s+=(double)H[n*K+k]*Wt[(size_t)o*K+k]; R[n*O+o]=s; }
  float *h,*w,*b,*out,*part; CK(cudaMalloc(&h,nh*4)); CK(cudaMalloc(&w,nw*4)); CK(cudaMalloc(&b,O*4)); CK(cudaMalloc(&out,(size_t)N*O*4)); CK(cudaMalloc(&part,(size_t)8*N*O*4));
  cudaMemcpy(h,H.data(),nh*4,cudaMemcpyHostToDevice); cudaMemcpy(w,Wt.data(),nw*4,cudaMemcpyHostToDevice); cudaMemcpy(b,B.data(),O*4,cudaMemcpyHostToDevice);
  auto check=[&](){ cudaMemcpy(Out.data(),out,(size_t)N*O*4,cudaMemcpyDeviceToHost); double e=0; for(size_t i=0;i<R.size();++i) e=std::max(e,(double)fabs(Out[i]-R[i])/(1+fabs(R[i]))); return e; };
  auto run=[&](const char* name, auto f){ cudaMemset(out,0xff,(size_t)N*O*4); f(); CK(cudaDeviceSynchronize()); double e=check(); float us=timeit(f); printf("N=%d K=%d O=%d %-28s %8.2f us  err %.1e  %.2f TB/s\n",N,K,O,name,us,e,nw*4/us/1e6); };
  constexpr int RW = N>16?2:(N>=16?4:(N>=8?8:N));
  run("noalloc 4 warps",[&]{ base<N,RW><<<O/(4*RW),dim3(32,4)>>>(h,w,b,out,K,O);});
  run("noalloc 8 warps",[&]{ base<N,RW><<<O/(8*RW),dim3(32,8)>>>(h,w,b,out,K,O);});
  auto sk=[&](auto kern, int S, int warps, int rw){ int smem=N*(K/S)*4; cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kern<<<dim3(O/(warps*rw),S),dim3(32,warps),smem>>>(h,w,b,part,K,O); };
  run("splitk S2 (+sum)",[&]{ sk(splitk<N,RW,2>,2,8,RW); sum_parts<2><<<(N*O+255)/256,256>>>(part,out,N*O);});
  run("splitk S4 (+sum)",[&]{ sk(splitk<N,RW,4>,4,8,RW); sum_parts<4><<<(N*O+255)/256,256>>>(part,out,N*O);});
  run("splitk S8 (+sum)",[&]{ sk(splitk<N,RW,8>,8,8,RW); sum_parts<8><<<(N*O+255)/256,256>>>(part,out,N*O);});
  run("splitk S4 4 warps (+sum)",[&]{ sk(splitk<N,RW,4>,4,4,RW); sum_parts<4><<<(N*O+255)/256,256>>>(part,out,N*O);});
  if (RW<=4) run("splitk S4 RW*2 (+sum)",[&]{ sk(splitk<N,(RW<=4?RW*2:RW),4>,4,8,(RW<=4?RW*2:RW)); sum_parts<4><<<(N*O+255)/256,256>>>(part,out,N*O);});
  run("splitk S8 4 warps (+sum)",[&]{ sk(splitk<N,RW,8>,8,4,RW); sum_parts<8><<<(N*O+255)/256,256>>>(part,out,N*O);});
  if (RW>1) run("splitk S4 RW/2 (+sum)",[&]{ sk(splitk<N,(RW>1?RW/2:1),4>,4,8,(RW>1?RW/2:1)); sum_parts<4><<<(N*O+255)/256,256>>>(part,out,N*O);});
  run("sum of 4 parts alone",[&]{ sum_parts<4><<<(N*O+255)/256,256>>>(part,out,N*O);});
  run("pre D1",[&]{ pre<N,RW,1><<<O/(4*RW),dim3(32,4)>>>(h,w,b,out,K,O);});
  run("pre D2",[&]{ pre<N,RW,2><<<O/(4*RW),dim3(32,4)>>>(h,w,b,out,K,O);});
  run("pre D3",[&]{ pre<N,RW,3><<<O/(4*RW),dim3(32,4)>>>(h,w,b,out,K,O);});
  if (RW>1) run("pre D2 RW/2",[&]{ pre<N,(RW>1?RW/2:1),2><<<O/(4*(RW>1?RW/2:1)),dim3(32,4)>>>(h,w,b,out,K,O);});
  if (RW>1) run("pre D3 RW/2",[&]{ pre<N,(RW>1?RW/2:1),3><<<O/(4*(RW>1?RW/2:1)),dim3(32,4)>>>(h,w,b,out,K,O);});
  cudaFree(h); cudaFree(w); cudaFree(b); cudaFree(out); cudaFree(part);
}

int main(){
  shape<16>(2048,6144); shape<16>(2048,8192); shape<12>(2048,8192); shape<8>(2048,8192); shape<16>(4096,16384); shape<16>(1536,6144); shape<4>(2048,8192);
}
