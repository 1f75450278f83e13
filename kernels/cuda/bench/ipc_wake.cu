// SPDX-License-Identifier: MIT
// Cross-process wake-up latency on one GPU (the cudaipc transport's frame flags, docs/BENCHMARKS.md
// "Frame flags"): a producer process runs a 200 us busy kernel, then signals (mode 0: an
// interprocess event's record; 1: cuStreamWriteValue32 on a flag in its memory; 2: a one-thread
// kernel writing the flag); a consumer process (fork) has enqueued its wait before the signal
// lands (0: cudaStreamWaitEvent on the opened event, after the record was enqueued; 1:
// cuStreamWaitValue32 GEQ on the IPC-mapped flag; 2: a spin kernel) and then a kernel stamping
// %globaltimer. Latency = the consumer's stamp - the producer's busy-kernel end stamp (one clock),
// median of 190 iterations (10 warm-up). Run it with and without MPS:
//     nvcc -O2 -arch=sm_90 -o ipc_wake kernels/cuda/bench/ipc_wake.cu && for m in 0 1 2; do ./ipc_wake $m; done
// Two arguments pick the two sides apart: `ipc_wake P W`, P the signal (0 event record, 1
// cuStreamWriteValue32, 2 a flag kernel, 3 the busy kernel writing the flag itself as it ends,
// 4 a flag kernel launched as the busy kernel's programmatic dependent (the busy kernel lets it
// launch at its start; it waits at griddepcontrol.wait, then stores the flag with release),
// W the wait (0 event wait, 1 cuStreamWaitValue32, 2 a spin kernel then the stamp, 3 a spin
// kernel that lets its dependents launch at once, the stamp launched as a programmatic
// dependent waiting at griddepcontrol.wait, 4 a spin kernel that lets its dependents launch only
// once it has seen the flag, the stamp a programmatic dependent as in 3: nothing after the wait
// is resident before the flag, so a waiting daemon holds one block, not its next stage).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>
#include <sys/mman.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1);} } while (0)
__device__ __forceinline__ unsigned long long gtime() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__global__ void busy(unsigned long long ns, unsigned long long *end, volatile unsigned *f, unsigned v, int trig) {
    if (trig) asm volatile("griddepcontrol.launch_dependents;");
    unsigned long long t0 = gtime(); while (gtime() - t0 < ns) {} if (end) *end = gtime();
    if (f) { __threadfence_system(); *f = v; } }
__global__ void stamp_pdl(unsigned long long *out) { asm volatile("griddepcontrol.wait;" ::: "memory"); *out = gtime(); }
__global__ void spinwait_pdl(volatile unsigned *f, unsigned v) { asm volatile("griddepcontrol.launch_dependents;"); while (*f < v) {} }
__global__ void spinwait_late(volatile unsigned *f, unsigned v) { while (*f < v) {} asm volatile("griddepcontrol.launch_dependents;"); }
__global__ void stamp(unsigned long long *out) { *out = gtime(); }
__global__ void setflag(volatile unsigned *f, unsigned v) { __threadfence_system(); *f = v; }
__global__ void setflag_pdl(unsigned *f, unsigned v) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(f), "r"(v) : "memory"); }
__global__ void spinwait(volatile unsigned *f, unsigned v) { while (*f < v) { __nanosleep(100); } }

// k on one thread, as the programmatic dependent of the stream's last kernel
template <typename... P, typename... A>
static void launch_pdl1(cudaStream_t st, void (*k)(P...), A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(1); cfg.blockDim = dim3(1); cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at; cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, k, args...));
}

struct shm { cudaIpcMemHandle_t mh; cudaIpcEventHandle_t eh; volatile int go, ready, stop; volatile int iter; };

int main(int argc, char **argv) {
    int mode = argc > 1 ? atoi(argv[1]) : 0; // 0 event, 1 wait-value + write-value, 2 spin kernel + flag kernel
    const int sig = mode, wt = argc > 2 ? atoi(argv[2]) : mode;
    const int N = 200;
    struct shm *S = (struct shm *)mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    memset((void *)S, 0, 4096);
    int pfd[2]; (void)pfd;
    pid_t pid = fork();
    if (pid == 0) { // consumer B
        while (!S->ready) usleep(100);
        CK(cudaSetDevice(0));
        cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        void *mem; CK(cudaIpcOpenMemHandle(&mem, S->mh, cudaIpcMemLazyEnablePeerAccess));
        cudaEvent_t ev; CK(cudaIpcOpenEventHandle(&ev, S->eh));
        unsigned *flag = (unsigned *)mem;
        unsigned long long *aend = (unsigned long long *)((char *)mem + 256);
        unsigned long long *bst; CK(cudaMalloc(&bst, N * 8));
        PFN_cuStreamWaitValue32_v11070 waitv = NULL;
        cudaDriverEntryPointQueryResult q;
        CK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", (void **)&waitv, 11070, cudaEnableDefault, &q));
        double sum = 0; double lat[N]; int n = 0;
        for (int i = 0; i < N; i++) {
            while (S->go != i + 1) {}
            // A's busy kernel (200 us) and its signal are enqueued: wait for it on the GPU
            if (wt == 0) CK(cudaStreamWaitEvent(st, ev, 0));
            else if (wt == 1) { CUresult r = waitv((CUstream)st, (CUdeviceptr)flag, (cuuint32_t)(i + 1), CU_STREAM_WAIT_VALUE_GEQ); if (r) { fprintf(stderr, "waitv %d\n", r); exit(1);} }
            else if (wt == 2) spinwait<<<1, 1, 0, st>>>(flag, i + 1);
            else if (wt == 3) spinwait_pdl<<<1, 1, 0, st>>>(flag, i + 1);
            else spinwait_late<<<1, 1, 0, st>>>(flag, i + 1);
            if (wt >= 3)
                launch_pdl1(st, stamp_pdl, bst + i);
            else
                stamp<<<1, 1, 0, st>>>(bst + i);
            CK(cudaStreamSynchronize(st));
            S->iter = i + 1;
            unsigned long long a, b;
            CK(cudaMemcpy(&a, aend + i, 8, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(&b, bst + i, 8, cudaMemcpyDeviceToHost));
            if (i >= 10) { lat[n++] = (double)(b - a) / 1e3; }
        }
        for (int i = 0; i < n; i++) sum += lat[i];
        // median
        for (int i = 0; i < n; i++) for (int j = i + 1; j < n; j++) if (lat[j] < lat[i]) { double t = lat[i]; lat[i] = lat[j]; lat[j] = t; }
        static const char *const sn[] = {"event record", "cuStreamWriteValue32", "flag kernel", "flag by the busy kernel", "flag kernel as a programmatic dependent"};
        static const char *const wn[] = {"event wait", "cuStreamWaitValue32", "spin kernel", "spin kernel + dependent launch",
                                         "spin kernel, dependents launched after the flag"};
        printf("signal %d / wait %d (%s / %s): wake-up latency mean %.2f us, median %.2f us, p90 %.2f us, min %.2f\n", sig, wt,
               sn[sig > 4 ? 0 : sig], wn[wt > 4 ? 0 : wt],
               sum / n, lat[n / 2], lat[n * 9 / 10], lat[0]);
        S->stop = 1;
        return 0;
    }
    // producer A
    CK(cudaSetDevice(0));
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    void *mem; CK(cudaMalloc(&mem, 1 << 20)); CK(cudaMemset(mem, 0, 1 << 20));
    cudaEvent_t ev; CK(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
    CK(cudaIpcGetMemHandle((cudaIpcMemHandle_t *)&S->mh, mem));
    CK(cudaIpcGetEventHandle((cudaIpcEventHandle_t *)&S->eh, ev));
    PFN_cuStreamWriteValue32_v11070 writev = NULL;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", (void **)&writev, 11070, cudaEnableDefault, &q));
    unsigned *flag = (unsigned *)mem;
    unsigned long long *aend = (unsigned long long *)((char *)mem + 256);
    // the first record must exist before B opens and waits on the event
    CK(cudaEventRecord(ev, st)); CK(cudaStreamSynchronize(st));
    S->ready = 1;
    for (int i = 0; i < N; i++) {
        while (S->iter != i) {}
        busy<<<1, 1, 0, st>>>(200000, aend + i, sig == 3 ? flag : NULL, (unsigned)(i + 1), sig == 4);
        if (sig == 3) {}
        else if (sig == 4)
            launch_pdl1(st, setflag_pdl, flag, (unsigned)(i + 1));
        else if (mode == 0) CK(cudaEventRecord(ev, st));
        else if (mode == 1) { CUresult r = writev((CUstream)st, (CUdeviceptr)flag, (cuuint32_t)(i + 1), CU_STREAM_WRITE_VALUE_DEFAULT); if (r) { fprintf(stderr, "writev %d\n", r); exit(1);} }
        else setflag<<<1, 1, 0, st>>>(flag, i + 1);
        S->go = i + 1;
        CK(cudaStreamSynchronize(st));
    }
    int status; waitpid(pid, &status, 0);
    return 0;
}
