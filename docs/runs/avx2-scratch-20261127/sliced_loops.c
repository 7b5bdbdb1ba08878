/* Scratch microbenchmark (2026-11-27, second session; not a test): the lane-sliced loops before they went into
 * decode_avx2.c -- 2-bit values (4 rows) and 3-bit keys (2 tokens x 4 rows), d = 128, against the shipped key loop.
 * gcc -O3 -march=native -o sliced_loops sliced_loops.c && ./sliced_loops  ->  sliced_loops.txt */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define SUB 512
#define N 512
uint8_t codes[N*48+64];
float pw[4*SUB];
float acc[4*128], qq[4*128];
#define T __attribute__((target("avx2,fma"),noinline))
/* values, 2-bit, lane-sliced: ymm of the token's 32 bytes; vector k (0..15) = coords {16i+k}; process 2 k per pass? */
T void mixL(long reps){
  const __m256 lo=_mm256_setr_ps(-1.5,-.5,.5,1.5,-1.5,-.5,.5,1.5);
  for(long rep=0;rep<reps;rep++) for(int k0=0;k0<16;k0+=2){
    __m256 a[8]; for(int r=0;r<4;r++){a[r]=_mm256_loadu_ps(acc+r*128+8*k0);a[4+r]=_mm256_loadu_ps(acc+r*128+8*k0+8);}
    const uint8_t*src=codes;
    for(int i=0;i<N;i++,src+=32){
      __m256i b=_mm256_loadu_si256((const __m256i*)src);
      __m256i s=_mm256_srli_epi32(b,2*k0);
      __m256 v0=_mm256_permutevar_ps(lo,s), v1=_mm256_permutevar_ps(lo,_mm256_srli_epi32(s,2));
      for(int r=0;r<4;r++){__m256 w=_mm256_broadcast_ss(pw+r*SUB+i); a[r]=_mm256_fmadd_ps(w,v0,a[r]); a[4+r]=_mm256_fmadd_ps(w,v1,a[4+r]);}
    }
    for(int r=0;r<4;r++){_mm256_storeu_ps(acc+r*128+8*k0,a[r]);_mm256_storeu_ps(acc+r*128+8*k0+8,a[4+r]);}
  }}
/* keys 3-bit, shipped design (2 tokens, broadcast word + srlv + vpermps) */
T float keysF(long reps){
  __m256i sh=_mm256_setr_epi32(0,3,6,9,12,15,18,21); __m256 lo=_mm256_setr_ps(-2.1,-1.3,-0.7,-0.2,0.2,0.7,1.3,2.1); float out=0; const float*q=qq;
  for(long r=0;r<reps;r++) for(int t=0;t<N;t+=2){ const uint8_t*p=codes+t*48,*p1=p+48; __m256 a0=_mm256_setzero_ps(),a1=a0,a2=a0,a3=a0,b0=a0,b1=a0,b2=a0,b3=a0;
    for(int g=0;g<16;g++){uint32_t w,w1;memcpy(&w,p+3*g,4);memcpy(&w1,p1+3*g,4);
      __m256 v=_mm256_permutevar8x32_ps(lo,_mm256_srlv_epi32(_mm256_set1_epi32(w),sh)), u=_mm256_permutevar8x32_ps(lo,_mm256_srlv_epi32(_mm256_set1_epi32(w1),sh));
      __m256 q0=_mm256_loadu_ps(q+8*g),q1=_mm256_loadu_ps(q+128+8*g),q2=_mm256_loadu_ps(q+256+8*g),q3=_mm256_loadu_ps(q+384+8*g);
      a0=_mm256_fmadd_ps(v,q0,a0);a1=_mm256_fmadd_ps(v,q1,a1);a2=_mm256_fmadd_ps(v,q2,a2);a3=_mm256_fmadd_ps(v,q3,a3);
      b0=_mm256_fmadd_ps(u,q0,b0);b1=_mm256_fmadd_ps(u,q1,b1);b2=_mm256_fmadd_ps(u,q2,b2);b3=_mm256_fmadd_ps(u,q3,b3);}
    __m256 s=_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)),_mm256_add_ps(_mm256_add_ps(b0,b1),_mm256_add_ps(b2,b3))); float o[8];_mm256_storeu_ps(o,s); out+=o[0];}
  return out;}
/* keys 3-bit lane-sliced: 48 bytes = two 24-byte halves; spread 3-byte groups to 32-bit lanes with vpermd-free trick:
   load 32 bytes at p and at p+24, vpshufb in-lane can't cross... use two 16-byte loads per half: lane0 bytes 0..11, lane1 bytes 12..23 */
T float keysL(long reps){
  __m256 lo=_mm256_setr_ps(-2.1,-1.3,-0.7,-0.2,0.2,0.7,1.3,2.1); float out=0; const float*q=qq;
  const __m256i spread=_mm256_setr_epi8(0,1,2,-1,3,4,5,-1,6,7,8,-1,9,10,11,-1, 0,1,2,-1,3,4,5,-1,6,7,8,-1,9,10,11,-1);
  for(long r=0;r<reps;r++) for(int t=0;t<N;t+=2){ const uint8_t*p=codes+t*48,*p1=p+48; __m256 a0=_mm256_setzero_ps(),a1=a0,a2=a0,a3=a0,b0=a0,b1=a0,b2=a0,b3=a0;
    for(int h=0;h<2;h++){ /* 64 coords: 24 bytes */
      __m256i x=_mm256_shuffle_epi8(_mm256_loadu2_m128i((const __m128i*)(p+24*h+12),(const __m128i*)(p+24*h)),spread);
      __m256i y=_mm256_shuffle_epi8(_mm256_loadu2_m128i((const __m128i*)(p1+24*h+12),(const __m128i*)(p1+24*h)),spread);
      for(int k=0;k<8;k++){ __m256 v=_mm256_permutevar8x32_ps(lo,x), u=_mm256_permutevar8x32_ps(lo,y); x=_mm256_srli_epi32(x,3); y=_mm256_srli_epi32(y,3);
      const float*qk=q+64*h+8*k;
      __m256 q0=_mm256_loadu_ps(qk),q1=_mm256_loadu_ps(qk+128),q2=_mm256_loadu_ps(qk+256),q3=_mm256_loadu_ps(qk+384);
      a0=_mm256_fmadd_ps(v,q0,a0);a1=_mm256_fmadd_ps(v,q1,a1);a2=_mm256_fmadd_ps(v,q2,a2);a3=_mm256_fmadd_ps(v,q3,a3);
      b0=_mm256_fmadd_ps(u,q0,b0);b1=_mm256_fmadd_ps(u,q1,b1);b2=_mm256_fmadd_ps(u,q2,b2);b3=_mm256_fmadd_ps(u,q3,b3);}}
    __m256 s=_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)),_mm256_add_ps(_mm256_add_ps(b0,b1),_mm256_add_ps(b2,b3))); float o[8];_mm256_storeu_ps(o,s); out+=o[0];}
  return out;}
int main(){ for(int i=0;i<N*48+64;i++) codes[i]=(uint8_t)(i*2654435761u>>13); for(int i=0;i<4*SUB;i++)pw[i]=1e-3f*(i%7); for(int i=0;i<512;i++)qq[i]=(i%7)*0.1f;
  long reps=2000; double t0,t; float x=0;
  for(int k=0;k<2;k++){
  t0=now(); mixL(reps); t=now()-t0; printf("values 2-bit lane-sliced: %.1f ns/token\n",t/(reps*N)*1e9);
  t0=now(); x+=keysF(reps); t=now()-t0; printf("keys 3-bit shipped: %.1f ns/token\n",t/(reps*N)*1e9);
  t0=now(); x+=keysL(reps); t=now()-t0; printf("keys 3-bit lane-sliced: %.1f ns/token\n",t/(reps*N)*1e9);}
  printf("guard %f %f\n",acc[5],x);}
