#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define DECL(i) __m512i a##i=_mm512_set1_epi32(i), s##i=_mm512_set1_epi32(7*i);
int main(){
  __m512i x=_mm512_set1_epi32(3), y=_mm512_set1_epi32(5);
  DECL(0)DECL(1)DECL(2)DECL(3)DECL(4)DECL(5)DECL(6)DECL(7)
  long N=50000000; double t, dt;
#define RUN(NAME, BODY) t=now(); for(long n=0;n<N;n++){ BODY __asm__ volatile("" : "+v"(x)); } dt=now()-t; \
  printf("%-28s %.3f ns per iter\n", NAME, dt/N*1e9);
#define DP(i) a##i=_mm512_dpwssd_epi32(a##i,x,y);
#define PB(i) s##i=_mm512_permutexvar_epi8(s##i,x);
#define MS(i) s##i=_mm512_multishift_epi64_epi8(x,s##i);
#define PT(i) s##i=_mm512_permutex2var_epi8(s##i,x,y);
  RUN("8 dp", DP(0)DP(1)DP(2)DP(3)DP(4)DP(5)DP(6)DP(7))
  RUN("8 vpermb", PB(0)PB(1)PB(2)PB(3)PB(4)PB(5)PB(6)PB(7))
  RUN("8 vpmultishiftqb", MS(0)MS(1)MS(2)MS(3)MS(4)MS(5)MS(6)MS(7))
  RUN("8 vpermt2b", PT(0)PT(1)PT(2)PT(3)PT(4)PT(5)PT(6)PT(7))
  RUN("8 dp + 8 vpermb", DP(0)PB(0)DP(1)PB(1)DP(2)PB(2)DP(3)PB(3)DP(4)PB(4)DP(5)PB(5)DP(6)PB(6)DP(7)PB(7))
  RUN("8 dp + 8 multishift", DP(0)MS(0)DP(1)MS(1)DP(2)MS(2)DP(3)MS(3)DP(4)MS(4)DP(5)MS(5)DP(6)MS(6)DP(7)MS(7))
#define CV(i) s##i=_mm512_cvtepi8_epi16(_mm512_castsi512_si256(s##i));

#define PW(i) s##i=_mm512_permutexvar_epi16(s##i,y);
#define RL(i) s##i=_mm512_rol_epi64(s##i,16);
#define BL(i) s##i=_mm512_mask_blend_epi16(0xAAAAAAAAu,s##i,y);
#define SV(i) s##i=_mm512_srlv_epi16(s##i,y);
  RUN("8 dp + 8 vpermw", DP(0)PW(0)DP(1)PW(1)DP(2)PW(2)DP(3)PW(3)DP(4)PW(4)DP(5)PW(5)DP(6)PW(6)DP(7)PW(7))
  RUN("8 dp + 8 vprolq", DP(0)RL(0)DP(1)RL(1)DP(2)RL(2)DP(3)RL(3)DP(4)RL(4)DP(5)RL(5)DP(6)RL(6)DP(7)RL(7))
  RUN("8 dp + 8 vpblendmw", DP(0)BL(0)DP(1)BL(1)DP(2)BL(2)DP(3)BL(3)DP(4)BL(4)DP(5)BL(5)DP(6)BL(6)DP(7)BL(7))
  RUN("8 dp + 8 vpsrlvw", DP(0)SV(0)DP(1)SV(1)DP(2)SV(2)DP(3)SV(3)DP(4)SV(4)DP(5)SV(5)DP(6)SV(6)DP(7)SV(7))
  RUN("8 dp+2pw+2rl+2bl+2sv", DP(0)PW(0)DP(1)PW(1)DP(2)RL(2)DP(3)RL(3)DP(4)BL(4)DP(5)BL(5)DP(6)SV(6)DP(7)SV(7))
  RUN("8 dp+2pb+2ms+2pt+2cv", DP(0)PB(0)DP(1)PB(1)DP(2)MS(2)DP(3)MS(3)DP(4)PT(4)DP(5)PT(5)DP(6)CV(6)DP(7)CV(7))
  RUN("8 vpermw", PW(0)PW(1)PW(2)PW(3)PW(4)PW(5)PW(6)PW(7))
#define SR(i) s##i=_mm512_srli_epi16(s##i,2);
#define AN(i) s##i=_mm512_and_si512(s##i,y);
#define SB(i) s##i=_mm512_shuffle_epi8(y,s##i);
#define BC(i) s##i=_mm512_add_epi32(s##i,_mm512_set1_epi32(n));
#define MB(i) a##i=_mm512_dpbusd_epi32(a##i,x,y);
  RUN("8 dp + 8 vpermt2b", DP(0)PT(0)DP(1)PT(1)DP(2)PT(2)DP(3)PT(3)DP(4)PT(4)DP(5)PT(5)DP(6)PT(6)DP(7)PT(7))
  RUN("8 dp + 8 srli", DP(0)SR(0)DP(1)SR(1)DP(2)SR(2)DP(3)SR(3)DP(4)SR(4)DP(5)SR(5)DP(6)SR(6)DP(7)SR(7))
  RUN("8 dp + 8 and", DP(0)AN(0)DP(1)AN(1)DP(2)AN(2)DP(3)AN(3)DP(4)AN(4)DP(5)AN(5)DP(6)AN(6)DP(7)AN(7))
  RUN("8 dp + 8 pshufb", DP(0)SB(0)DP(1)SB(1)DP(2)SB(2)DP(3)SB(3)DP(4)SB(4)DP(5)SB(5)DP(6)SB(6)DP(7)SB(7))
  RUN("8 dp + 8 vpmovsxbw", DP(0)CV(0)DP(1)CV(1)DP(2)CV(2)DP(3)CV(3)DP(4)CV(4)DP(5)CV(5)DP(6)CV(6)DP(7)CV(7))
  RUN("8 dpbusd + 8 vpermb", MB(0)PB(0)MB(1)PB(1)MB(2)PB(2)MB(3)PB(3)MB(4)PB(4)MB(5)PB(5)MB(6)PB(6)MB(7)PB(7))
  RUN("8 srli", SR(0)SR(1)SR(2)SR(3)SR(4)SR(5)SR(6)SR(7))
  RUN("8 dp + 16 srli/and", DP(0)SR(0)AN(0)DP(1)SR(1)AN(1)DP(2)SR(2)AN(2)DP(3)SR(3)AN(3)DP(4)SR(4)AN(4)DP(5)SR(5)AN(5)DP(6)SR(6)AN(6)DP(7)SR(7)AN(7))
  __m512i r=_mm512_add_epi32(a0,s0);
#define ADD(i) r=_mm512_add_epi32(r,_mm512_add_epi32(a##i,s##i));
  ADD(1)ADD(2)ADD(3)ADD(4)ADD(5)ADD(6)ADD(7)
  printf("(%d)\n", _mm512_reduce_add_epi32(r));
}
