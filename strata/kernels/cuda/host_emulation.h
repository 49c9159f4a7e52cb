// Host (g++) emulation of the device helpers mmvq_decode.cuh uses, so the chunk decoders can
// be checked bit-exact against strata.kernels.dequant on a machine without a GPU
// (tests/test_cuda_decode_host.py). Mirrors mmvq_common.cuh; prmt/__byte_perm/funnelshift/dp4a
// semantics as the PTX ISA defines them.
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#define __device__
#define __forceinline__ inline
typedef unsigned char u8; typedef signed char i8; typedef unsigned short u16; typedef unsigned int u32; typedef int i32; typedef unsigned long long u64;
struct uint2 { u32 x, y; }; struct uint4 { u32 x, y, z, w; }; static inline uint2 make_uint2(u32 a, u32 b){ return uint2{a,b}; }
static inline float __uint_as_float(u32 u){ float f; memcpy(&f,&u,4); return f; }
template<class T> static inline T __ldg(const T* p){ return *p; }
static inline int __popc(u32 x){ return __builtin_popcount(x); }
static inline u32 __funnelshift_r(u32 lo, u32 hi, u32 sh){ return (u32)((((u64)hi<<32)|lo) >> (sh&31)); }
static inline u32 prmt_impl(u32 a, u32 b, u32 sel, bool signmode){
  u64 v = ((u64)b<<32)|a; u32 r=0;
  for(int n=0;n<4;n++){ u32 s=(sel>>(4*n))&15; u32 byte=(v>>(8*(s&7)))&0xFF; if(signmode && (s&8)) byte = (byte&0x80)?0xFF:0; r |= byte<<(8*n);} return r; }
static inline u32 __byte_perm(u32 a,u32 b,u32 s){ return prmt_impl(a,b,s,false); }
static inline u32 prmt(u32 a,u32 b,u32 s){ return prmt_impl(a,b,s,true); }
static inline float h2f(u16 h){ u32 s=(h>>15)&1, e=(h>>10)&31, m=h&1023; float v;
  if(e==0) v = ldexpf((float)m, -24); else if(e==31) v = m? NAN: INFINITY; else v = ldexpf((float)(m|1024), (int)e-25);
  return s? -v: v; }
static inline u32 ld8(const u8* p){ return *p; }
static inline u32 ld16(const u8* p){ u16 v; memcpy(&v,p,2); return v; }
static inline u32 ld32a(const u8* p){ u32 v; memcpy(&v,p,4); return v; }
static inline u32 ld32u(const u8* p){ u32 v; memcpy(&v,p,4); return v; }
static inline float ldh(const u8* p){ return h2f((u16)ld16(p)); }
template <int N> static inline void ldwords(const u8* p, u32 (&w)[N]){ for(int i=0;i<N;i++) w[i]=ld32u(p+4*i); }
template <int N,int M> static inline void ldwords2(const u8* p,int dist,u32 (&w)[N],u32 (&v)[M]){ ldwords(p,w); ldwords(p+dist,v); }
static inline u32 sign_mask4(u32 s4){ return prmt(s4*0x10204080u, 0u, 0xBA98u); }
static inline u32 spread4(u32 b4){ return (b4*0x00204081u)&0x01010101u; }
static inline u32 apply_signs(u32 g,u32 m){ return (g^m)+(m&0x01010101u); }
static inline u32 ksigns(u32 s7){ return s7 | ((__popc(s7)&1u)<<7); }
#define __host__
struct Chunk { int q[8]; float sc[2]; float mn[2]; int neg[8]; };

