#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include <sys/mman.h>
#include <string.h>
typedef int (*gemm_fn)(const float *, int64_t, int64_t, int64_t, int64_t, const void *, int,
    const float *, const float *, float *, int, int, const float *, const float *, float, int);
static double cpu(){struct timespec t;clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
static double peak(void){ long n=2000000; double t=cpu();
  __asm__ volatile("mov %0, %%rcx\n1:\n"
   "vfmadd231ps %%ymm1,%%ymm2,%%ymm4\n vfmadd231ps %%ymm1,%%ymm2,%%ymm5\n vfmadd231ps %%ymm1,%%ymm2,%%ymm6\n vfmadd231ps %%ymm1,%%ymm2,%%ymm7\n"
   "vfmadd231ps %%ymm1,%%ymm2,%%ymm8\n vfmadd231ps %%ymm1,%%ymm2,%%ymm9\n vfmadd231ps %%ymm1,%%ymm2,%%ymm10\n vfmadd231ps %%ymm1,%%ymm2,%%ymm11\n"
   "vfmadd231ps %%ymm1,%%ymm2,%%ymm12\n vfmadd231ps %%ymm1,%%ymm2,%%ymm13\n vfmadd231ps %%ymm1,%%ymm2,%%ymm14\n vfmadd231ps %%ymm1,%%ymm2,%%ymm15\n"
   "dec %%rcx\n jnz 1b\n" :: "r"(n) : "rcx","xmm1","xmm2","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15","cc");
  return n*12*16/(cpu()-t)/1e9; }
#define NS 7
int main(int argc,char**argv){
  int nt=atoi(argv[1]), rounds=atoi(argv[2]), M=atoi(argv[3]); int nv=argc-4;
  gemm_fn f[8];
  for(int v=0;v<nv;v++){void*h=dlopen(argv[4+v],RTLD_NOW|RTLD_LOCAL); if(!h){printf("%s\n",dlerror());return 1;} f[v]=(gemm_fn)dlsym(h,"gemm");}
  int64_t shapes[7][2]={{2304,768},{768,768},{3072,768},{768,3072},{50272,768},{96,768},{96,256}};
  const char*names[7]={"qkv","out_proj","fc1","fc2","lm_head","hot96x768","hot96x256"};
  double r[7][8][64], q[7][8][64], rt[7][8][64];
  float *x=malloc(4*M*3072), *out=malloc(4*M*50272), *bias=malloc(4*50272);
  for(int i=0;i<M*3072;i++)x[i]=(rand()%1000)/1000.0f-0.5f;
  for(int i=0;i<50272;i++)bias[i]=0.1f;
  float *w[7];
  for(int s=0;s<NS;s++){int64_t n=(shapes[s][0]+15)/16*16,k=shapes[s][1]; w[s]=aligned_alloc(2<<20,(n*k*4+(2<<20)-1)/(2<<20)*(2<<20)); madvise(w[s],n*k*4,14); for(int64_t i=0;i<n*k;i++)w[s][i]=(rand()%1000)/1000.0f-0.5f;}
  { float *o0=malloc(4*M*50272), *res=malloc(4*M*50272); for(int i=0;i<M*50272;i++)res[i]=(i%13)*0.01f-0.05f;
    for(int s=0;s<NS;s++) for(int mode=0;mode<3;mode++) for(int mm=1;mm<=M;mm+=(mm<8?1:13)) { int64_t n=shapes[s][0],k=shapes[s][1];
      f[0](x,k,mm,k,n,w[s],0,mode?bias:NULL,mode==2?res:NULL,o0,mode==1,0,NULL,NULL,0,nt);
      for(int v=1;v<nv;v++){ f[v](x,k,mm,k,n,w[s],0,mode?bias:NULL,mode==2?res:NULL,out,mode==1,0,NULL,NULL,0,nt);
        if(memcmp(o0,out,4*mm*n)) printf("MISMATCH v%d shape %d mode %d m %d\n",v,s,mode,mm);}}
    printf("check done\n"); }
  for(int rd=0;rd<rounds;rd++) for(int s=0;s<NS;s++) for(int v=0;v<nv;v++){
    int64_t n=shapes[s][0],k=shapes[s][1]; int reps= n>10000?3:n<100?200:20;
    f[v](x,k,M,k,n,w[s],0,bias,NULL,out,0,0,NULL,NULL,0,nt);
    double pk=peak(); double t=cpu(); for(int i=0;i<reps;i++) f[v](x,k,M,k,n,w[s],0,bias,NULL,out,0,0,NULL,NULL,0,nt);
    r[s][v][rd]=2.0*M*n*k*reps/(cpu()-t)/1e9; q[s][v][rd]=r[s][v][rd]/pk/(nt>1?1:1); if(v==nv-1) for(int u=0;u<nv;u++) rt[s][u][rd]=r[s][u][rd]/r[s][0][rd];
  }
  for(int s=0;s<NS;s++){printf("%-9s",names[s]); for(int v=0;v<nv;v++){qsort(r[s][v],rounds,sizeof(double),cmp); qsort(q[s][v],rounds,sizeof(double),cmp); qsort(rt[s][v],rounds,sizeof(double),cmp); printf("  x%.3f",rt[s][v][rounds/2]); printf("  v%d %5.1f [%5.1f-%5.1f] %.2fpk",v,r[s][v][rounds/2],r[s][v][0],r[s][v][rounds-1],q[s][v][rounds/2]);} printf("\n");}
}
