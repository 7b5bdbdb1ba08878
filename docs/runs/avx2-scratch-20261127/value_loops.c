/* Scratch microbenchmark (2026-11-27, second session; not a test): the shipped 2-bit value loop (variant 0) and
 * what its parts cost: 1 one 32-bit load for both chunks, 2 no unpacking (FMAs and weight broadcasts only), 3-6
 * broadcast from memory with and without the shift / the permute; B 4 chunks per pass.
 * gcc -O3 -march=native -o value_loops value_loops.c && ./value_loops  ->  value_loops.txt */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define SUB 512
#define N 512
uint8_t codes[N*32+64];
float pw[4*SUB];
float acc[4*128];
#define T __attribute__((target("avx2,fma"),noinline))
/* shipped: 2 chunks x 4 rows, per chunk pass over tokens */
T void mixA(long reps, int variant){
  const __m256i sh=_mm256_setr_epi32(0,2,4,6,8,10,12,14); const __m256 lo=_mm256_setr_ps(-1.5,-.5,.5,1.5,-1.5,-.5,.5,1.5);
  for(long rep=0;rep<reps;rep++) for(int c0=0;c0<128;c0+=16){
    __m256 a[8]; for(int r=0;r<4;r++){a[r]=_mm256_loadu_ps(acc+r*128+c0);a[4+r]=_mm256_loadu_ps(acc+r*128+c0+8);}
    const uint8_t*src=codes+(c0/8)*2;
    for(int i=0;i<N;i++,src+=32){
      __m256 v0,v1;
      if(variant==0){uint16_t h;memcpy(&h,src,2);v0=_mm256_permutevar_ps(lo,_mm256_srlv_epi32(_mm256_set1_epi32(h),sh));
        memcpy(&h,src+2,2);v1=_mm256_permutevar_ps(lo,_mm256_srlv_epi32(_mm256_set1_epi32(h),sh));}
      else if(variant==1){ /* one 32-bit load, both chunks: shifts differ by 16 */
        uint32_t w;memcpy(&w,src,4); __m256i b=_mm256_set1_epi32(w);
        v0=_mm256_permutevar_ps(lo,_mm256_srlv_epi32(b,sh)); v1=_mm256_permutevar_ps(lo,_mm256_srli_epi32(_mm256_srlv_epi32(b,sh),16));}
      else if(variant==3){ /* memory broadcast, srlv, permilps */
        __m256i b=_mm256_castps_si256(_mm256_broadcast_ss((const float*)src));
        __m256i s=_mm256_srlv_epi32(b,sh); v0=_mm256_permutevar_ps(lo,s); v1=_mm256_permutevar_ps(lo,_mm256_srli_epi32(s,16));}
      else if(variant==4){ /* memory broadcast, no shift: permilps only */
        __m256i b=_mm256_castps_si256(_mm256_broadcast_ss((const float*)src));
        v0=_mm256_permutevar_ps(lo,b); v1=_mm256_permutevar_ps(lo,_mm256_srli_epi32(b,16));}
      else if(variant==5){ /* memory broadcast, srlv only */
        __m256i b=_mm256_castps_si256(_mm256_broadcast_ss((const float*)src));
        __m256i s=_mm256_srlv_epi32(b,sh); v0=_mm256_castsi256_ps(s); v1=_mm256_castsi256_ps(_mm256_srli_epi32(s,16));}
      else if(variant==6){ /* mullo-free: vpsllvd replaced by vpmulld? no: use and+cmpeq? use pshufb-free: sllv */
        __m256i b=_mm256_castps_si256(_mm256_broadcast_ss((const float*)src));
        __m256i s=_mm256_sllv_epi32(b,sh); v0=_mm256_permutevar_ps(lo,s); v1=_mm256_permutevar_ps(lo,_mm256_srli_epi32(s,16));}
      else {v0=_mm256_castsi256_ps(_mm256_set1_epi32(src[0]));v1=v0;}
      for(int r=0;r<4;r++){__m256 b=_mm256_broadcast_ss(pw+r*SUB+i); a[r]=_mm256_fmadd_ps(b,v0,a[r]); a[4+r]=_mm256_fmadd_ps(b,v1,a[4+r]);}
    }
    for(int r=0;r<4;r++){_mm256_storeu_ps(acc+r*128+c0,a[r]);_mm256_storeu_ps(acc+r*128+c0+8,a[4+r]);}
  }}
/* B: 4 chunks (32 coords) x 2 rows? no: 3 chunks x 4 rows = 12 acc */
T void mixB(long reps){
  const __m256i sh=_mm256_setr_epi32(0,2,4,6,8,10,12,14); const __m256 lo=_mm256_setr_ps(-1.5,-.5,.5,1.5,-1.5,-.5,.5,1.5);
  for(long rep=0;rep<reps;rep++) for(int c0=0;c0<128;c0+=32){
    __m256 a[16]; for(int r=0;r<4;r++)for(int k=0;k<4;k++)a[4*k+r]=_mm256_loadu_ps(acc+r*128+c0+8*k);
    const uint8_t*src=codes+(c0/8)*2;
    for(int i=0;i<N;i++,src+=32){
      uint64_t w;memcpy(&w,src,8); __m256i b0=_mm256_set1_epi32((uint32_t)w), b1=_mm256_set1_epi32((uint32_t)(w>>32));
      __m256i s0=_mm256_srlv_epi32(b0,sh), s1=_mm256_srlv_epi32(b1,sh);
      __m256 v[4]={_mm256_permutevar_ps(lo,s0),_mm256_permutevar_ps(lo,_mm256_srli_epi32(s0,16)),_mm256_permutevar_ps(lo,s1),_mm256_permutevar_ps(lo,_mm256_srli_epi32(s1,16))};
      for(int r=0;r<4;r++){__m256 b=_mm256_broadcast_ss(pw+r*SUB+i); for(int k=0;k<3;k++) a[4*k+r]=_mm256_fmadd_ps(b,v[k],a[4*k+r]);}
      /* 4th chunk uses 4 more accs: 16 acc total + temporaries -> spills; measure anyway */
      for(int r=0;r<4;r++){__m256 b=_mm256_broadcast_ss(pw+r*SUB+i); a[12+r]=_mm256_fmadd_ps(b,v[3],a[12+r]);}
    }
    for(int r=0;r<4;r++)for(int k=0;k<4;k++)_mm256_storeu_ps(acc+r*128+c0+8*k,a[4*k+r]);
  }}
int main(){ for(int i=0;i<N*32+64;i++) codes[i]=(uint8_t)(i*2654435761u>>13); for(int i=0;i<4*SUB;i++)pw[i]=1e-3f*(i%7);
  long reps=2000; double t0,t;
  for(int v=0;v<7;v++){ t0=now(); mixA(reps,v); t=now()-t0; printf("A variant %d: %.1f ns/token\n",v,t/(reps*N)*1e9);}
  t0=now(); mixB(reps); t=now()-t0; printf("B 32 coords x 4 rows: %.1f ns/token\n",t/(reps*N)*1e9);
  printf("guard %f\n",acc[5]);}
