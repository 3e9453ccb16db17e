/*
 * A fake libcuda.so for flash_qla's loader tests (no GPU needed). Build:
 *     gcc -shared -fPIC -O1 -o libfakecuda.so fake_libcuda.c
 * and point FLASH_QLA_LIBCUDA at it. Behaviour is read from the environment at every call:
 *     FAKE_CUDA_DRIVER_VERSION   cuDriverGetVersion result (default 13000)
 *     FAKE_CUDA_DEVICE_COUNT     number of devices (default 1; 0 makes cuInit fail with CUDA_ERROR_NO_DEVICE)
 *     FAKE_CUDA_CC               compute capability "major.minor" (default "9.0")
 *     FAKE_CUDA_NAME             device name (default "Fake NVIDIA H100")
 *     FAKE_CUDA_FAIL             "cuModuleLoadData=200,cuLaunchKernel=1": make those calls return that CUresult
 *     FAKE_CUDA_NO_PROC_ADDRESS  "1": cuGetProcAddress* fail, so the caller must fall back to dlsym
 * A fake cubin is text: "FAKECUBIN\n" then one "<symbol> <signature>\n" line per kernel (signature as in
 * flash_qla._launcher.launch: p/i/l/f/m), so cuLaunchKernel knows each parameter's size and records the bytes.
 * The recorded state is read back through the fake_* functions (ctypes on the same path shares the instance).
 * Like the real driver: module loads and tensor-map encodes need a current context; a launch on the legacy stream with no current
 * context fails with CUDA_ERROR_INVALID_CONTEXT; dynamic smem above 48 KiB needs the function attribute.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef struct { int dev; int primary; } FakeCtx;
typedef struct { char symbol[128]; char sig[128]; int max_smem; void *module; } FakeFunc;
typedef struct { FakeCtx *ctx; FakeFunc funcs[16]; int nfuncs; } FakeModule;

static FakeCtx g_ctx[16];
static __thread FakeCtx *t_current = NULL;

static struct {
    long init, driver_version, proc_lookups, module_loads, get_function, set_attr, encodes, launches, retains,
        set_current, events, event_records, stream_waits;
} st;

static struct {
    unsigned grid[3], block[3], smem;
    uint64_t stream;
    char symbol[128];
    unsigned char params[4096];
    int nbytes;
} last_launch;
static int last_attr_value = -1, last_attr_kind = -1;

static int env_int(const char *name, int dflt) {
    const char *v = getenv(name);
    return (v && *v) ? atoi(v) : dflt;
}

/* The CUresult FAKE_CUDA_FAIL assigns to `fn`, or 0. */
static CUresult fail_code(const char *fn) {
    const char *spec = getenv("FAKE_CUDA_FAIL");
    if (!spec) return 0;
    size_t n = strlen(fn);
    for (const char *p = spec; (p = strstr(p, fn)) != NULL; p += n) {
        if ((p == spec || p[-1] == ',') && p[n] == '=') return atoi(p + n + 1);
    }
    return 0;
}
#define FAIL_IF_ASKED(name)                        \
    do {                                           \
        CUresult _rc = fail_code(name);            \
        if (_rc) return _rc;                       \
    } while (0)

static int device_count(void) { return env_int("FAKE_CUDA_DEVICE_COUNT", 1); }

CUresult cuInit(unsigned flags) {
    FAIL_IF_ASKED("cuInit");
    st.init++;
    if (flags != 0) return 1;
    if (device_count() <= 0) return 100; /* CUDA_ERROR_NO_DEVICE */
    return 0;
}

CUresult cuDriverGetVersion(int *v) {
    FAIL_IF_ASKED("cuDriverGetVersion");
    st.driver_version++;
    *v = env_int("FAKE_CUDA_DRIVER_VERSION", 13000);
    return 0;
}

CUresult cuDeviceGetCount(int *n) {
    FAIL_IF_ASKED("cuDeviceGetCount");
    *n = device_count();
    return 0;
}

CUresult cuDeviceGet(int *dev, int ordinal) {
    FAIL_IF_ASKED("cuDeviceGet");
    if (ordinal < 0 || ordinal >= device_count() || ordinal >= 16) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *dev = ordinal;
    return 0;
}

CUresult cuDeviceGetAttribute(int *out, int attr, int dev) {
    FAIL_IF_ASKED("cuDeviceGetAttribute");
    if (dev < 0 || dev >= device_count()) return 101;
    const char *cc = getenv("FAKE_CUDA_CC");
    int major = 9, minor = 0;
    if (cc && *cc) sscanf(cc, "%d.%d", &major, &minor);
    if (attr == 75) *out = major;
    else if (attr == 76) *out = minor;
    else return 1;
    return 0;
}

CUresult cuDeviceGetName(char *name, int len, int dev) {
    FAIL_IF_ASKED("cuDeviceGetName");
    if (dev < 0 || dev >= device_count()) return 101;
    const char *n = getenv("FAKE_CUDA_NAME");
    snprintf(name, (size_t)len, "%s", (n && *n) ? n : "Fake NVIDIA H100");
    return 0;
}

CUresult cuCtxGetCurrent(void **ctx) {
    FAIL_IF_ASKED("cuCtxGetCurrent");
    *ctx = t_current;
    return 0;
}

CUresult cuCtxSetCurrent(void *ctx) {
    FAIL_IF_ASKED("cuCtxSetCurrent");
    st.set_current++;
    t_current = (FakeCtx *)ctx;
    return 0;
}

CUresult cuCtxGetDevice(int *dev) {
    if (t_current == NULL) return 201;
    *dev = t_current->dev;
    return 0;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    FAIL_IF_ASKED("cuDevicePrimaryCtxRetain");
    if (dev < 0 || dev >= device_count() || dev >= 16) return 101;
    st.retains++;
    g_ctx[dev].dev = dev;
    g_ctx[dev].primary = 1;
    *ctx = &g_ctx[dev];
    return 0;
}

CUresult cuModuleLoadData(void **module, const void *image) {
    FAIL_IF_ASKED("cuModuleLoadData");
    if (t_current == NULL) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    const char *text = (const char *)image;
    if (strncmp(text, "FAKECUBIN\n", 10) != 0) return 200; /* CUDA_ERROR_INVALID_IMAGE */
    FakeModule *m = (FakeModule *)calloc(1, sizeof *m);
    m->ctx = t_current;
    const char *p = text + 10;
    while (*p && m->nfuncs < 16) {
        FakeFunc *f = &m->funcs[m->nfuncs];
        if (sscanf(p, "%127s %127s", f->symbol, f->sig) != 2) break;
        if (strcmp(f->sig, "-") == 0) f->sig[0] = '\0';
        f->module = m;
        m->nfuncs++;
        const char *nl = strchr(p, '\n');
        if (!nl) break;
        p = nl + 1;
    }
    st.module_loads++;
    *module = m;
    return 0;
}

CUresult cuModuleGetFunction(void **fn, void *module, const char *name) {
    FAIL_IF_ASKED("cuModuleGetFunction");
    FakeModule *m = (FakeModule *)module;
    st.get_function++;
    for (int i = 0; i < m->nfuncs; i++) {
        if (strcmp(m->funcs[i].symbol, name) == 0) {
            *fn = &m->funcs[i];
            return 0;
        }
    }
    return 500; /* CUDA_ERROR_NOT_FOUND */
}

CUresult cuFuncSetAttribute(void *fn, int attr, int value) {
    FAIL_IF_ASKED("cuFuncSetAttribute");
    st.set_attr++;
    last_attr_kind = attr;
    last_attr_value = value;
    if (attr == 8) {
        if (value > 227 * 1024) return 1;
        ((FakeFunc *)fn)->max_smem = value;
    }
    return 0;
}

#ifndef FAKE_NO_TENSORMAP /* -DFAKE_NO_TENSORMAP builds a pre-CUDA-12 driver */
/* The encoded "map": a readable record of the arguments (the test decodes it from the recorded param bytes). */
typedef struct {
    uint32_t magic, dtype, rank, interleave, swizzle, l2, oob, pad;
    uint64_t addr;
    uint32_t dims[5], strides[4], box[5], estr[5];
} FakeMap;

CUresult cuTensorMapEncodeTiled(void *map, int dtype, uint32_t rank, void *addr, const uint64_t *dims,
                                const uint64_t *strides, const uint32_t *box, const uint32_t *estr, int interleave,
                                int swizzle, int l2, int oob) {
    FAIL_IF_ASKED("cuTensorMapEncodeTiled");
    if (t_current == NULL) return 201; /* like the real driver: the encoder needs a current context */
    if (((uintptr_t)map) % 64 != 0) return 1;                  /* the real one needs 64-byte alignment */
    if (rank < 1 || rank > 5 || ((uintptr_t)addr) % 16 != 0) return 1;
    for (uint32_t i = 0; i + 1 < rank; i++)
        if (strides[i] % 16 != 0) return 1;
    for (uint32_t i = 0; i < rank; i++)
        if (box[i] == 0 || box[i] > 256 || estr[i] == 0 || estr[i] > 8) return 1;
    st.encodes++;
    FakeMap fm;
    memset(&fm, 0, sizeof fm);
    fm.magic = 0x544d4150; /* 'TMAP' */
    fm.dtype = (uint32_t)dtype;
    fm.rank = rank;
    fm.interleave = (uint32_t)interleave;
    fm.swizzle = (uint32_t)swizzle;
    fm.l2 = (uint32_t)l2;
    fm.oob = (uint32_t)oob;
    fm.addr = (uint64_t)(uintptr_t)addr;
    for (uint32_t i = 0; i < rank; i++) {
        fm.dims[i] = (uint32_t)dims[i];
        fm.box[i] = box[i];
        fm.estr[i] = estr[i];
        if (i + 1 < rank) fm.strides[i] = (uint32_t)strides[i];
    }
    memset(map, 0, 128);
    memcpy(map, &fm, sizeof fm);
    return 0;
}
#endif

CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, void *stream, void **params, void **extra) {
    FAIL_IF_ASKED("cuLaunchKernel");
    FakeFunc *f = (FakeFunc *)fn;
    if (stream == NULL && t_current == NULL) return 201; /* legacy stream needs a current context */
    if (gx == 0 || gy == 0 || gz == 0 || bx * by * bz > 1024 || bx * by * bz == 0) return 1;
    if (smem > 48 * 1024 && (int)smem > f->max_smem) return 1; /* attribute not raised */
    if (extra != NULL) return 1;
    int off = 0;
    for (const char *s = f->sig; *s; s++, params++) {
        int sz = (*s == 'p' || *s == 'l') ? 8 : (*s == 'i' || *s == 'f') ? 4 : (*s == 'm') ? 128 : -1;
        if (sz < 0 || off + sz > (int)sizeof last_launch.params) return 1;
        memcpy(last_launch.params + off, *params, (size_t)sz);
        off += sz;
    }
    st.launches++;
    last_launch.grid[0] = gx; last_launch.grid[1] = gy; last_launch.grid[2] = gz;
    last_launch.block[0] = bx; last_launch.block[1] = by; last_launch.block[2] = bz;
    last_launch.smem = smem;
    last_launch.stream = (uint64_t)(uintptr_t)stream;
    snprintf(last_launch.symbol, sizeof last_launch.symbol, "%s", f->symbol);
    last_launch.nbytes = off;
    return 0;
}

/* Events: a counter each; the fake keeps no order between streams. */
static int g_event_storage[256];

CUresult cuEventCreate(void **ev, unsigned flags) {
    FAIL_IF_ASKED("cuEventCreate");
    if (t_current == NULL) return 201;
    *ev = &g_event_storage[st.events++ % 256];
    return 0;
}

CUresult cuEventDestroy(void *ev) { return 0; }

CUresult cuEventRecord(void *ev, void *stream) {
    FAIL_IF_ASKED("cuEventRecord");
    st.event_records++;
    return 0;
}

CUresult cuStreamWaitEvent(void *stream, void *ev, unsigned flags) {
    FAIL_IF_ASKED("cuStreamWaitEvent");
    st.stream_waits++;
    return 0;
}

static const struct { int code; const char *name, *desc; } g_errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {209, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

CUresult cuGetErrorName(CUresult code, const char **out) {
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++)
        if (g_errors[i].code == code) { *out = g_errors[i].name; return 0; }
    *out = NULL;
    return 1;
}

CUresult cuGetErrorString(CUresult code, const char **out) {
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++)
        if (g_errors[i].code == code) { *out = g_errors[i].desc; return 0; }
    *out = NULL;
    return 1;
}

static const struct { const char *name; void *fn; } g_procs[] = {
    {"cuInit", (void *)cuInit},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount},
    {"cuDeviceGet", (void *)cuDeviceGet},
    {"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute},
    {"cuDeviceGetName", (void *)cuDeviceGetName},
    {"cuCtxGetCurrent", (void *)cuCtxGetCurrent},
    {"cuCtxSetCurrent", (void *)cuCtxSetCurrent},
    {"cuCtxGetDevice", (void *)cuCtxGetDevice},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
    {"cuModuleLoadData", (void *)cuModuleLoadData},
    {"cuModuleGetFunction", (void *)cuModuleGetFunction},
    {"cuFuncSetAttribute", (void *)cuFuncSetAttribute},
#ifndef FAKE_NO_TENSORMAP
    {"cuTensorMapEncodeTiled", (void *)cuTensorMapEncodeTiled},
#endif
    {"cuLaunchKernel", (void *)cuLaunchKernel},
    {"cuEventCreate", (void *)cuEventCreate},
    {"cuEventDestroy", (void *)cuEventDestroy},
    {"cuEventRecord", (void *)cuEventRecord},
    {"cuStreamWaitEvent", (void *)cuStreamWaitEvent},
    {"cuGetErrorString", (void *)cuGetErrorString},
    {"cuGetErrorName", (void *)cuGetErrorName},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
    st.proc_lookups++;
    *pfn = NULL;
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    if (env_int("FAKE_CUDA_NO_PROC_ADDRESS", 0)) return 500;
    for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++) {
        if (strcmp(g_procs[i].name, symbol) == 0) {
            *pfn = g_procs[i].fn;
            if (status) *status = 0;
            return 0;
        }
    }
    return 500;
}

/* ---- inspection, for the tests (ctypes) ---- */

long fake_stat(const char *name) {
#define S(x) if (strcmp(name, #x) == 0) return st.x;
    S(init) S(driver_version) S(proc_lookups) S(module_loads) S(get_function) S(set_attr) S(encodes) S(launches)
    S(retains) S(set_current) S(events) S(event_records) S(stream_waits)
#undef S
    return -1;
}

void fake_reset(void) {
    memset(&st, 0, sizeof st);
    memset(&last_launch, 0, sizeof last_launch);
    last_attr_value = last_attr_kind = -1;
}

/* grid[3], block[3], smem, stream, symbol (cap 128), params (cap bytes); returns the number of param bytes. */
int fake_last_launch(unsigned *grid, unsigned *block, unsigned *smem, uint64_t *stream, char *symbol,
                     unsigned char *params, int cap) {
    memcpy(grid, last_launch.grid, sizeof last_launch.grid);
    memcpy(block, last_launch.block, sizeof last_launch.block);
    *smem = last_launch.smem;
    *stream = last_launch.stream;
    snprintf(symbol, 128, "%s", last_launch.symbol);
    int n = last_launch.nbytes < cap ? last_launch.nbytes : cap;
    memcpy(params, last_launch.params, (size_t)n);
    return last_launch.nbytes;
}

int fake_last_attr(int *kind) {
    *kind = last_attr_kind;
    return last_attr_value;
}

void *fake_current_context(void) { return t_current; }
