/* Scratch microbenchmark (2026-11-27, not a test): key-scoring inner loops of the CPU decode on 3-bit codes, d = 128,
 * 4 query rows, 4096 tokens x 50 repeats, one thread:
 *   A  the shipped fp32 AVX2 design, one token at a time: broadcast word, vpsrlvd, vpermps, 4 FMAs per 8 codes
 *   B  A with two in-lane vpermilps + blendv instead of the lane-crossing vpermps
 *   C  FMAs and query loads only (no unpacking): the floor of the fp32 design
 *   D  int8: 32 codes unpacked to bytes (vpshufb spread, vpmullw as a per-lane shift, packus, vpshufb table),
 *      vpmaddubsw + vpmaddwd per row, WITHOUT the sign handling a signed table needs (a lower bound)
 *   E  D with the sign trick that keeps decode_vnni.c's exact int32 sums (maddubs(|c|, sign(q, c))), two tokens
 *      per iteration sharing the query loads
 *   F  A with two tokens per iteration sharing the query loads (what decode_avx2.c does)
 * Build and run: gcc -O2 -march=x86-64 -o key_loops key_loops.c && ./key_loops   (codes and queries are arbitrary:
 * only the time is read; the printed sum is a guard against dead-code elimination) */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define N 4096
uint8_t codes[N*48+64];
float cent[8]={-2.1,-1.3,-0.7,-0.2,0.2,0.7,1.3,2.1};
__attribute__((target("avx2,fma"),noinline)) float fma_only(long iters){
  __m256 a0=_mm256_set1_ps(0),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,x=_mm256_set1_ps(1.0001f),y=_mm256_set1_ps(0.9999f);
  for(long i=0;i<iters;i++){a0=_mm256_fmadd_ps(x,y,a0);a1=_mm256_fmadd_ps(x,y,a1);a2=_mm256_fmadd_ps(x,y,a2);a3=_mm256_fmadd_ps(x,y,a3);
  a4=_mm256_fmadd_ps(x,y,a4);a5=_mm256_fmadd_ps(x,y,a5);a6=_mm256_fmadd_ps(x,y,a6);a7=_mm256_fmadd_ps(x,y,a7);}
  __m256 s=_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)),_mm256_add_ps(_mm256_add_ps(a4,a5),_mm256_add_ps(a6,a7)));
  float o[8];_mm256_storeu_ps(o,s);return o[0];}
/* variant A: current: broadcast, srlv, vpermps ; 3 bits, 16 groups per token, 4 rows FMA */
__attribute__((target("avx2,fma"),noinline)) float keysA(const float*q,long reps){
  __m256i sh=_mm256_setr_epi32(0,3,6,9,12,15,18,21); __m256 lo=_mm256_loadu_ps(cent); float out=0;
  for(long r=0;r<reps;r++) for(int t=0;t<N;t++){ const uint8_t*p=codes+t*48; __m256 a0=_mm256_setzero_ps(),a1=a0,a2=a0,a3=a0;
    for(int g=0;g<16;g++){uint32_t w;memcpy(&w,p+3*g,4);__m256i idx=_mm256_srlv_epi32(_mm256_set1_epi32(w),sh);__m256 v=_mm256_permutevar8x32_ps(lo,idx);
      a0=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+8*g),a0);a1=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+128+8*g),a1);a2=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+256+8*g),a2);a3=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+384+8*g),a3);}
    __m256 s=_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)); float o[8];_mm256_storeu_ps(o,s); out+=o[0];}
  return out;}
/* variant B: srlv + two vpermilps + blendv */
__attribute__((target("avx2,fma"),noinline)) float keysB(const float*q,long reps){
  __m256i sh=_mm256_setr_epi32(0,3,6,9,12,15,18,21); __m256 lo=_mm256_setr_ps(cent[0],cent[1],cent[2],cent[3],cent[0],cent[1],cent[2],cent[3]);
  __m256 hi=_mm256_setr_ps(cent[4],cent[5],cent[6],cent[7],cent[4],cent[5],cent[6],cent[7]); float out=0;
  for(long r=0;r<reps;r++) for(int t=0;t<N;t++){ const uint8_t*p=codes+t*48; __m256 a0=_mm256_setzero_ps(),a1=a0,a2=a0,a3=a0;
    for(int g=0;g<16;g++){uint32_t w;memcpy(&w,p+3*g,4);__m256i idx=_mm256_srlv_epi32(_mm256_set1_epi32(w),sh);
      __m256 v=_mm256_blendv_ps(_mm256_permutevar_ps(lo,idx),_mm256_permutevar_ps(hi,idx),_mm256_castsi256_ps(_mm256_slli_epi32(idx,29)));
      a0=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+8*g),a0);a1=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+128+8*g),a1);a2=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+256+8*g),a2);a3=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+384+8*g),a3);}
    __m256 s=_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)); float o[8];_mm256_storeu_ps(o,s); out+=o[0];}
  return out;}
/* variant C: no unpack (FMA + q loads only): floor */
__attribute__((target("avx2,fma"),noinline)) float keysC(const float*q,long reps){
  float out=0;
  for(long r=0;r<reps;r++) for(int t=0;t<N;t++){ const float*p=(const float*)(codes+t*48); __m256 a0=_mm256_setzero_ps(),a1=a0,a2=a0,a3=a0;
    for(int g=0;g<16;g++){__m256 v=_mm256_broadcast_ss(p+(g%12));
      a0=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+8*g),a0);a1=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+128+8*g),a1);a2=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+256+8*g),a2);a3=_mm256_fmadd_ps(v,_mm256_loadu_ps(q+384+8*g),a3);}
    __m256 s=_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)); float o[8];_mm256_storeu_ps(o,s); out+=o[0];}
  return out;}
/* variant D: integer: unpack 3-bit 32 codes to bytes via pshufb + mullo16 ... simplified: lookup via pshufb on assumed bytes, maddubs+madd */
__attribute__((target("avx2,fma"),noinline)) float keysD(const int8_t*q8,long reps){
  const __m256i tab=_mm256_setr_epi8(1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8);
  const __m256i ones=_mm256_set1_epi16(1), m7=_mm256_set1_epi8(7); int out=0;
  /* spread: for 16 codes from 6 bytes: 16-bit lane k holds bytes (3k/8, 3k/8+1); per 128-bit lane 8 codes = 3 bytes */
  const __m256i spread=_mm256_setr_epi8(0,1,0,1,0,1,1,2,1,2,1,2,2,3,2,3, 0,1,0,1,0,1,1,2,1,2,1,2,2,3,2,3);
  const __m256i mul=_mm256_setr_epi16(1<<8,1<<5,1<<2,1<<7,1<<4,1<<1,1<<6,1<<3, 1<<8,1<<5,1<<2,1<<7,1<<4,1<<1,1<<6,1<<3);
  for(long r=0;r<reps;r++) for(int t=0;t<N;t++){ const uint8_t*p=codes+t*48; __m256i a0=_mm256_setzero_si256(),a1=a0,a2=a0,a3=a0;
    for(int c=0;c<4;c++){ /* 32 codes = 12 bytes: lanes hold 8 codes each? use 4 x 16-bit-lane blocks */
      const uint8_t*pc=p+12*c;
      __m128i b0=_mm_loadu_si128((const __m128i*)pc); /* bytes 0..15 */
      __m256i raw=_mm256_setr_m128i(b0,_mm_srli_si128(b0,6)); /* lane0 bytes 0-5 (16 codes), lane1 bytes 6-11 */
      /* 16 codes per lane need 16-bit lanes x 16 -> two vectors */
      __m256i s0=_mm256_shuffle_epi8(raw,spread); /* codes 0-7 of lane (bytes 0..2) */
      __m256i s1=_mm256_shuffle_epi8(_mm256_srli_si256(raw,3),spread); /* codes 8-15 (bytes 3..5) */
      __m256i e0=_mm256_srli_epi16(_mm256_mullo_epi16(s0,mul),8), e1=_mm256_srli_epi16(_mm256_mullo_epi16(s1,mul),8);
      __m256i codes8=_mm256_and_si256(_mm256_packus_epi16(e0,e1),m7);
      __m256i v=_mm256_shuffle_epi8(tab,codes8);
#define ROW(R) { __m256i qr=_mm256_loadu_si256((const __m256i*)(q8+R*128+32*c)); a##R=_mm256_add_epi32(a##R,_mm256_madd_epi16(_mm256_maddubs_epi16(v,qr),ones)); }
      ROW(0) ROW(1) ROW(2) ROW(3)
    }
    __m256i s=_mm256_add_epi32(_mm256_add_epi32(a0,a1),_mm256_add_epi32(a2,a3)); int o[8];_mm256_storeu_si256((__m256i*)o,s); out+=o[0];}
  return out;}
/* E: int8 with sign trick, two tokens per iteration */
__attribute__((target("avx2,fma"),noinline)) float keysE(const int8_t*q8,long reps){
  const __m256i tab=_mm256_setr_epi8(-7,-5,-3,-1,1,3,5,7,-7,-5,-3,-1,1,3,5,7,-7,-5,-3,-1,1,3,5,7,-7,-5,-3,-1,1,3,5,7);
  const __m256i ones=_mm256_set1_epi16(1), m7=_mm256_set1_epi8(7); int out=0;
  const __m256i spread=_mm256_setr_epi8(0,1,0,1,0,1,1,2,1,2,1,2,2,3,2,3, 0,1,0,1,0,1,1,2,1,2,1,2,2,3,2,3);
  const __m256i mul=_mm256_setr_epi16(1<<8,1<<5,1<<2,1<<7,1<<4,1<<1,1<<6,1<<3, 1<<8,1<<5,1<<2,1<<7,1<<4,1<<1,1<<6,1<<3);
#define UNPACK(PC, V) { __m128i b0=_mm_loadu_si128((const __m128i*)(PC)); __m256i raw=_mm256_setr_m128i(b0,_mm_srli_si128(b0,6)); \
      __m256i s0=_mm256_shuffle_epi8(raw,spread), s1=_mm256_shuffle_epi8(_mm256_srli_si256(raw,3),spread); \
      __m256i e0=_mm256_srli_epi16(_mm256_mullo_epi16(s0,mul),8), e1=_mm256_srli_epi16(_mm256_mullo_epi16(s1,mul),8); \
      V=_mm256_shuffle_epi8(tab,_mm256_and_si256(_mm256_packus_epi16(e0,e1),m7)); }
  for(long r=0;r<reps;r++) for(int t=0;t<N;t+=2){ const uint8_t*p=codes+t*48,*p1=p+48;
    __m256i a0=_mm256_setzero_si256(),a1=a0,a2=a0,a3=a0,b0=a0,b1=a0,b2=a0,b3=a0;
    for(int c=0;c<4;c++){ __m256i v,w; UNPACK(p+12*c,v) UNPACK(p1+12*c,w)
      const __m256i av=_mm256_abs_epi8(v), aw=_mm256_abs_epi8(w);
#define ROWE(R) { __m256i qr=_mm256_loadu_si256((const __m256i*)(q8+R*128+32*c)); \
      a##R=_mm256_add_epi32(a##R,_mm256_madd_epi16(_mm256_maddubs_epi16(av,_mm256_sign_epi8(qr,v)),ones)); \
      b##R=_mm256_add_epi32(b##R,_mm256_madd_epi16(_mm256_maddubs_epi16(aw,_mm256_sign_epi8(qr,w)),ones)); }
      ROWE(0) ROWE(1) ROWE(2) ROWE(3)
    }
    __m256i s=_mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0,a1),_mm256_add_epi32(a2,a3)),_mm256_add_epi32(_mm256_add_epi32(b0,b1),_mm256_add_epi32(b2,b3)));
    int o[8];_mm256_storeu_si256((__m256i*)o,s); out+=o[0];}
  return out;}
/* F: the shipped design with two tokens per iteration */
__attribute__((target("avx2,fma"),noinline)) float keysF(const float*q,long reps){
  __m256i sh=_mm256_setr_epi32(0,3,6,9,12,15,18,21); __m256 lo=_mm256_loadu_ps(cent); float out=0;
  for(long r=0;r<reps;r++) for(int t=0;t<N;t+=2){ const uint8_t*p=codes+t*48,*p1=p+48; __m256 a0=_mm256_setzero_ps(),a1=a0,a2=a0,a3=a0,b0=a0,b1=a0,b2=a0,b3=a0;
    for(int g=0;g<16;g++){uint32_t w,w1;memcpy(&w,p+3*g,4);memcpy(&w1,p1+3*g,4);
      __m256 v=_mm256_permutevar8x32_ps(lo,_mm256_srlv_epi32(_mm256_set1_epi32(w),sh)), u=_mm256_permutevar8x32_ps(lo,_mm256_srlv_epi32(_mm256_set1_epi32(w1),sh));
      __m256 q0=_mm256_loadu_ps(q+8*g),q1=_mm256_loadu_ps(q+128+8*g),q2=_mm256_loadu_ps(q+256+8*g),q3=_mm256_loadu_ps(q+384+8*g);
      a0=_mm256_fmadd_ps(v,q0,a0);a1=_mm256_fmadd_ps(v,q1,a1);a2=_mm256_fmadd_ps(v,q2,a2);a3=_mm256_fmadd_ps(v,q3,a3);
      b0=_mm256_fmadd_ps(u,q0,b0);b1=_mm256_fmadd_ps(u,q1,b1);b2=_mm256_fmadd_ps(u,q2,b2);b3=_mm256_fmadd_ps(u,q3,b3);}
    __m256 s=_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)),_mm256_add_ps(_mm256_add_ps(b0,b1),_mm256_add_ps(b2,b3))); float o[8];_mm256_storeu_ps(o,s); out+=o[0];}
  return out;}
int main(){ for(int i=0;i<N*48+64;i++) codes[i]=(uint8_t)(i*2654435761u>>13); float q[512]; int8_t q8[512]; for(int i=0;i<512;i++){q[i]=(i%7)*0.1f;q8[i]=(int8_t)(i%50-25);}
  double t0=now(); float x=fma_only(100000000); double t=now()-t0; printf("fma: %.3f ns per ymm FMA (8 per iter) -> %.2f GHz if 1/cycle\n", t/8e8*1e9, 8e8/t/1e9);
  long reps=50; 
  t0=now(); x+=keysA(q,reps); t=now()-t0; printf("A current vpermps: %.1f ns/token\n", t/(reps*N)*1e9);
  t0=now(); x+=keysB(q,reps); t=now()-t0; printf("B vpermilps+blend: %.1f ns/token\n", t/(reps*N)*1e9);
  t0=now(); x+=keysC(q,reps); t=now()-t0; printf("C FMA only: %.1f ns/token\n", t/(reps*N)*1e9);
  t0=now(); x+=keysD(q8,reps); t=now()-t0; printf("D int8 maddubs: %.1f ns/token\n", t/(reps*N)*1e9);
  t0=now(); x+=keysE(q8,reps); t=now()-t0; printf("E int8 sign trick, 2 tokens: %.1f ns/token\n", t/(reps*N)*1e9);
  t0=now(); x+=keysF(q,reps); t=now()-t0; printf("F fp32 2 tokens (shipped): %.1f ns/token\n", t/(reps*N)*1e9);
  printf("guard %f\n",x); }
