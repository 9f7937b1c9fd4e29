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
// at O 6144, more than L1 keeps beside W. splitk reads h once a block but loses everywhere
// (H200, 2026-11-29, us, base 4 warps / S2 / S4 with the sums): 16 2048 6144 23.1 / 39.5 /
// 48.6; 16 4096 16384 89.9 / 211.7 / 157.4; 8 2048 8192 23.1 / 38.9 / 46.4; 4 2048 8192 19.6
// / 22.9 / 24.1 (a slice's blocks each stage N x K/S of h before their first product, and
// the parts' sums cost 4-5 us alone). A slice must be a multiple of 128 of K.
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

__device__ __forceinline__ float4 ldg_stream(const float* p){  // as ldg_na, reorderable
  float4 v; asm("ld.global.nc.L1::no_allocate.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x),"=f"(v.y),"=f"(v.z),"=f"(v.w) : "l"(p)); return v; }

__device__ __forceinline__ void mma_tf32(float (&d)[4], const float (&a)[4], float b0, float b1){
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3])
      : "r"(__float_as_uint(a[0])),"r"(__float_as_uint(a[1])),"r"(__float_as_uint(a[2])),"r"(__float_as_uint(a[3])),
        "r"(__float_as_uint(b0)),"r"(__float_as_uint(b1)));
}

// TF32 on tensor cores (mma m16n8k8: the batch M, 8 rows of W N): a block stages its slice of K
// (blockIdx.y of KS) of h [N <= 16, K] in shared memory once (rows padded by 16 floats: a
// phase's two rows fall on distinct banks), each warp NT tiles of 8 rows of W over the slice,
// W read past L1 16 bytes a lane, U chunks of 16 k ahead. Lane (g, q) reads W[row g][16c + 4q
// .. +3]: k permuted within the chunk, its 4 values two k-steps' B fragments, h's A fragments
// permuted the same way. Sums added atomically where KS > 1 (out zeroed first).
template<int N, int NT, int U>
__global__ void __launch_bounds__(256) tf32mma(const float* __restrict__ h, const float* __restrict__ W, const float* __restrict__ b, float* out, int K, int O, int KS){
  extern __shared__ float hs[];
  int lane=threadIdx.x, warp=threadIdx.y, warps=blockDim.y, g=lane>>2, q=lane&3;
  int kl=K/KS, k0=blockIdx.y*kl, ld=kl+16;
  for(int i=warp*32+lane;i<16*kl/4;i+=warps*32){ int n=i/(kl/4), kk=(i%(kl/4))*4;
    *(float4*)(hs+n*ld+kk) = n<N ? *(const float4*)(h+(size_t)n*K+k0+kk) : make_float4(0.f,0.f,0.f,0.f); }
  __syncthreads();
  int row0=(blockIdx.x*warps+warp)*8*NT;
  float d[NT][4];
#pragma unroll
  for(int t=0;t<NT;++t) d[t][0]=d[t][1]=d[t][2]=d[t][3]=0.f;
  const float* wr=W+(size_t)(row0+g)*K+k0+4*q;
  const float* ha=hs+g*ld+4*q; const float* hb=hs+(g+8)*ld+4*q;
  float4 cur[U][NT], nxt[U][NT];
#pragma unroll
  for(int u=0;u<U;++u)
#pragma unroll
    for(int t=0;t<NT;++t) cur[u][t]=ldg_stream(wr+(size_t)t*8*K+16*u);
  for(int kb=0;kb<kl;kb+=16*U){
    if(kb+16*U<kl){
#pragma unroll
      for(int u=0;u<U;++u)
#pragma unroll
        for(int t=0;t<NT;++t) nxt[u][t]=ldg_stream(wr+(size_t)t*8*K+kb+16*(U+u));
    }
#pragma unroll
    for(int u=0;u<U;++u){ float4 x=*(const float4*)(ha+kb+16*u), y=*(const float4*)(hb+kb+16*u);
      float a0[4]={x.x,y.x,x.y,y.y}, a1[4]={x.z,y.z,x.w,y.w};
#pragma unroll
      for(int t=0;t<NT;++t){ mma_tf32(d[t],a0,cur[u][t].x,cur[u][t].y); mma_tf32(d[t],a1,cur[u][t].z,cur[u][t].w); } }
#pragma unroll
    for(int u=0;u<U;++u)
#pragma unroll
      for(int t=0;t<NT;++t) cur[u][t]=nxt[u][t];
  }
#pragma unroll
  for(int t=0;t<NT;++t){ int o=row0+t*8+2*q; float b0=0.f, b1=0.f;
    if(blockIdx.y==0){ b0=b[o]; b1=b[o+1]; }
    float v[4]={d[t][0]+b0,d[t][1]+b1,d[t][2]+b0,d[t][3]+b1};
    int rows[2]={g,g+8};
#pragma unroll
    for(int i=0;i<4;++i){ int n=rows[i>>1]; if(n<N){ float* p=out+(size_t)n*O+o+(i&1); if(KS>1) atomicAdd(p,v[i]); else *p=v[i]; } } }
}

template<typename F> float timeit(F f){ cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b); std::vector<float> t;
  for(int i=0;i<5;++i) f();
  for(int rep=0;rep<15;++rep){ cudaEventRecord(a); for(int i=0;i<50;++i) f(); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms,a,b); t.push_back(ms*1000/50);} 
  std::sort(t.begin(),t.end()); CK(cudaGetLastError()); return t[t.size()/2]; }

template<int N> void shape(int K, int O){
  size_t nh=(size_t)N*K, nw=(size_t)O*K; std::vector<float> H(nh),Wt(nw),B(O),R((size_t)N*O),Out((size_t)N*O);
  srand(1); for(auto&x:H)x=rand()/(float)RAND_MAX-0.5f; for(auto&x:Wt)x=(rand()/(float)RAND_MAX-0.5f)*0.05f; for(auto&x:B)x=rand()/(float)RAND_MAX;
  for(int n=0;n<N;++n) for(int o=0;o<O;++o){ double s=B[o]; for(int k=0;k<K;++k) s+=(double)H[n*K+k]*Wt[(size_t)o*K+k]; R[n*O+o]=s; }
  float *h,*w,*b,*out; CK(cudaMalloc(&h,nh*4)); CK(cudaMalloc(&w,nw*4)); CK(cudaMalloc(&b,O*4)); CK(cudaMalloc(&out,(size_t)N*O*4));
  cudaMemcpy(h,H.data(),nh*4,cudaMemcpyHostToDevice); cudaMemcpy(w,Wt.data(),nw*4,cudaMemcpyHostToDevice); cudaMemcpy(b,B.data(),O*4,cudaMemcpyHostToDevice);
  auto check=[&](){ cudaMemcpy(Out.data(),out,(size_t)N*O*4,cudaMemcpyDeviceToHost); double e=0; for(size_t i=0;i<R.size();++i) e=std::max(e,(double)fabs(Out[i]-R[i])/(1+fabs(R[i]))); return e; };
  auto run=[&](const char* name, auto f){ cudaMemset(out,0xff,(size_t)N*O*4); f(); CK(cudaDeviceSynchronize()); double e=check(); float us=timeit(f); printf("N=%d K=%d O=%d %-28s %8.2f us  err %.1e  %.2f TB/s\n",N,K,O,name,us,e,nw*4/us/1e6); };
  constexpr int RW = N>16?2:(N>=16?4:(N>=8?8:N));
  run("noalloc 4 warps",[&]{ base<N,RW><<<O/(4*RW),dim3(32,4)>>>(h,w,b,out,K,O);});
  run("noalloc 8 warps",[&]{ base<N,RW><<<O/(8*RW),dim3(32,8)>>>(h,w,b,out,K,O);});
  auto mma=[&](auto kern, int warps, int nt, int ks){ int smem=16*(K/ks+16)*4;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if(ks>1) cudaMemsetAsync(out,0,(size_t)N*O*4);
    kern<<<dim3(O/(8*nt*warps),ks),dim3(32,warps),smem>>>(h,w,b,out,K,O,ks); };
  int ks=K>2048?2:1;  // h's slice in shared memory at most 2048 x 16 floats
  run("tf32 8 warps NT1 U4",[&]{ mma(tf32mma<N,1,4>,8,1,ks);});
  run("tf32 8 warps NT1 U8",[&]{ mma(tf32mma<N,1,8>,8,1,ks);});
  run("tf32 4 warps NT2 U4",[&]{ mma(tf32mma<N,2,4>,4,2,ks);});
  run("tf32 8 warps NT1 U4 KS2",[&]{ mma(tf32mma<N,1,4>,8,1,2*ks);});
  run("tf32 4 warps NT1 U8",[&]{ mma(tf32mma<N,1,8>,4,1,ks);});
  cudaFree(h); cudaFree(w); cudaFree(b); cudaFree(out);
}

int main(){
  shape<16>(2048,6144); shape<16>(2048,8192); shape<12>(2048,8192); shape<9>(2048,8192); shape<8>(2048,8192);
  shape<16>(4096,16384); shape<16>(1536,6144); shape<16>(2560,7680); shape<4>(2048,8192);
}
