/*
 * flash_qla._launcher: the zero-JIT kernel launcher.
 *
 * A CPython extension written against the limited API (abi3, CPython >= 3.10) so one wheel serves every
 * interpreter and every torch. It links neither the CUDA toolkit nor libtorch and does not include cuda.h:
 * the few driver types and prototypes it needs are declared below, and libcuda.so.1 is dlopen()ed at the
 * first call that needs it (never at import). FLASH_QLA_LIBCUDA overrides the library path (tests point it at
 * a fake driver).
 *
 * Python API (all handles are Python ints):
 *   driver_version() -> int                      CUDA driver API version, e.g. 13000 (no cuInit needed)
 *   device_count() -> int
 *   device_capability(ordinal) -> (major, minor)
 *   device_name(ordinal) -> str
 *   load_module(ordinal, cubin: bytes) -> module   into the current context if it is on that device, else
 *                                                  into the device's primary context (retained for good)
 *   get_function(module, symbol: str, dyn_smem: int, carveout: int = -1) -> function
 *   launch(function, grid3, block3, smem, stream, signature, args) -> None
 *   tensormap_cache_info() -> (hits, misses, entries)
 *   clear_tensormap_cache() -> None
 *   libcuda_path() -> str | None                 the library that was loaded (None before first use)
 *   program_new(ops, nslots, nstreams) -> program  a plan's launch sequence with its per-call values left open
 *   program_run(program, streams, pointers) -> None  issue it: one crossing from Python per call
 *
 * launch() signature: one char per kernel parameter: 'p' pointer/uint64 (int or None), 'i' int32, 'l' int64,
 * 'f' float32, 'm' CUtensorMap given as the tuple
 *   (dtype, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2_promotion, oob_fill)
 * (exactly cuTensorMapEncodeTiled's arguments; strides are the rank-1 byte strides of dims 1..rank-1).
 * Encoded maps are kept in a small set-associative cache keyed on the full tuple contents, so a repeated launch
 * with the same tensors encodes nothing. A grid with a zero dimension launches nothing.
 *
 * Concurrency: lazy driver initialisation, module loads and function look-ups run under a mutex; launch() and
 * the tensor-map cache rely on the GIL (the launch path never releases it). launch() does no synchronisation
 * and no device allocation, so it can be captured into a CUDA graph.
 */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------------------ */
/* Driver API declarations (ABI as of CUDA 12.0; requested through cuGetProcAddress with cudaVersion 12000) */

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef uint64_t cuuint64_t;
typedef uint32_t cuuint32_t;
typedef struct { _Alignas(64) uint64_t opaque[16]; } CUtensorMap; /* 128 bytes, 64-byte aligned */

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8
#define CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT 9
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM 1
#define FQ_REQUEST_VERSION 12000
#define FQ_NEEDED_DRIVER_API 12000 /* cuTensorMapEncodeTiled appeared in CUDA 12.0 */
#define FQ_DEFAULT_SMEM_LIMIT (48 * 1024)

typedef CUresult (*PFN_cuGetProcAddress_v1)(const char *, void **, int, cuuint64_t);
typedef CUresult (*PFN_cuGetProcAddress_v2)(const char *, void **, int, cuuint64_t, int *);
typedef CUresult (*PFN_cuInit)(unsigned int);
typedef CUresult (*PFN_cuDriverGetVersion)(int *);
typedef CUresult (*PFN_cuDeviceGetCount)(int *);
typedef CUresult (*PFN_cuDeviceGet)(CUdevice *, int);
typedef CUresult (*PFN_cuDeviceGetAttribute)(int *, int, CUdevice);
typedef CUresult (*PFN_cuDeviceGetName)(char *, int, CUdevice);
typedef CUresult (*PFN_cuCtxGetCurrent)(CUcontext *);
typedef CUresult (*PFN_cuCtxSetCurrent)(CUcontext);
typedef CUresult (*PFN_cuCtxGetDevice)(CUdevice *);
typedef CUresult (*PFN_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
typedef CUresult (*PFN_cuModuleLoadData)(CUmodule *, const void *);
typedef CUresult (*PFN_cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
typedef CUresult (*PFN_cuFuncSetAttribute)(CUfunction, int, int);
typedef CUresult (*PFN_cuTensorMapEncodeTiled)(CUtensorMap *, int, cuuint32_t, void *, const cuuint64_t *,
                                               const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, int,
                                               int, int, int);
typedef CUresult (*PFN_cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                       unsigned, CUstream, void **, void **);
typedef CUresult (*PFN_cuEventCreate)(CUevent *, unsigned int);
typedef CUresult (*PFN_cuEventDestroy)(CUevent);
typedef CUresult (*PFN_cuEventRecord)(CUevent, CUstream);
typedef CUresult (*PFN_cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
typedef CUresult (*PFN_cuGetErrorString)(CUresult, const char **);
typedef CUresult (*PFN_cuGetErrorName)(CUresult, const char **);

static struct {
    PFN_cuInit Init;
    PFN_cuDriverGetVersion DriverGetVersion;
    PFN_cuDeviceGetCount DeviceGetCount;
    PFN_cuDeviceGet DeviceGet;
    PFN_cuDeviceGetAttribute DeviceGetAttribute;
    PFN_cuDeviceGetName DeviceGetName;
    PFN_cuCtxGetCurrent CtxGetCurrent;
    PFN_cuCtxSetCurrent CtxSetCurrent;
    PFN_cuCtxGetDevice CtxGetDevice;
    PFN_cuDevicePrimaryCtxRetain DevicePrimaryCtxRetain;
    PFN_cuModuleLoadData ModuleLoadData;
    PFN_cuModuleGetFunction ModuleGetFunction;
    PFN_cuFuncSetAttribute FuncSetAttribute;
    PFN_cuTensorMapEncodeTiled TensorMapEncodeTiled;
    PFN_cuLaunchKernel LaunchKernel;
    PFN_cuEventCreate EventCreate;
    PFN_cuEventDestroy EventDestroy;
    PFN_cuEventRecord EventRecord;
    PFN_cuStreamWaitEvent StreamWaitEvent;
    PFN_cuGetErrorString GetErrorString;
    PFN_cuGetErrorName GetErrorName;
} cu;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static void *g_lib = NULL;           /* dlopen handle, set once every symbol resolved */
static char g_lib_path[1024];
static int g_initialised = 0;        /* cuInit(0) succeeded */

/* ------------------------------------------------------------------------------------------------------ */
/* Errors: raised as flash_qla.errors classes (imported on first error), RuntimeError if that import fails. */

static PyObject *errors_attr(const char *name) {
    PyObject *mod = PyImport_ImportModule("flash_qla.errors");
    if (mod == NULL) {
        PyErr_Clear();
        Py_INCREF(PyExc_RuntimeError);
        return PyExc_RuntimeError;
    }
    PyObject *cls = PyObject_GetAttrString(mod, name);
    Py_DECREF(mod);
    if (cls == NULL) {
        PyErr_Clear();
        Py_INCREF(PyExc_RuntimeError);
        return PyExc_RuntimeError;
    }
    return cls;
}

static void raise_instance(PyObject *cls, PyObject *args) {
    if (args == NULL) { Py_DECREF(cls); return; }
    PyObject *exc = PyObject_CallObject(cls, args);
    Py_DECREF(args);
    if (exc != NULL) {
        PyErr_SetObject(cls, exc);
        Py_DECREF(exc);
    }
    Py_DECREF(cls);
}

/* Raise CudaDriverError(what, code, name, description). Returns NULL for convenience. */
static PyObject *raise_cu(CUresult rc, const char *fmt, ...) {
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    const char *name = NULL, *desc = NULL;
    if (cu.GetErrorName == NULL || cu.GetErrorName(rc, &name) != CUDA_SUCCESS || name == NULL)
        name = "CUDA_ERROR_UNKNOWN_CODE";
    if (cu.GetErrorString == NULL || cu.GetErrorString(rc, &desc) != CUDA_SUCCESS || desc == NULL)
        desc = "unrecognised error code";
    PyObject *cls = errors_attr("CudaDriverError");
    raise_instance(cls, Py_BuildValue("(siss)", what, (int)rc, name, desc));
    return NULL;
}

/* ------------------------------------------------------------------------------------------------------ */
/* Lazy driver loading */

static void *resolve(void *lib, void *gpa, int gpa_v2, const char *name) {
    void *fn = NULL;
    if (gpa != NULL) {
        CUresult rc;
        if (gpa_v2) {
            int status = 0;
            rc = ((PFN_cuGetProcAddress_v2)gpa)(name, &fn, FQ_REQUEST_VERSION, CU_GET_PROC_ADDRESS_LEGACY_STREAM,
                                                &status);
        } else {
            rc = ((PFN_cuGetProcAddress_v1)gpa)(name, &fn, FQ_REQUEST_VERSION, CU_GET_PROC_ADDRESS_LEGACY_STREAM);
        }
        if (rc != CUDA_SUCCESS) fn = NULL;
    }
    if (fn == NULL) fn = dlsym(lib, name);
    return fn;
}

/* Caller holds g_lock. Returns 0 on success, -1 with a Python exception set. */
static int load_driver_locked(void) {
    if (g_lib != NULL) return 0;
    const char *path = getenv("FLASH_QLA_LIBCUDA");
    if (path == NULL || path[0] == '\0') path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *err = dlerror();
        PyObject *cls = errors_attr("DriverNotFoundError");
        raise_instance(cls, Py_BuildValue("(ss)", path, err ? err : "dlopen failed"));
        return -1;
    }
    void *gpa = dlsym(lib, "cuGetProcAddress_v2");
    int gpa_v2 = gpa != NULL;
    if (gpa == NULL) gpa = dlsym(lib, "cuGetProcAddress");

    struct { const char *name; void **slot; } table[] = {
        {"cuInit", (void **)&cu.Init},
        {"cuDriverGetVersion", (void **)&cu.DriverGetVersion},
        {"cuDeviceGetCount", (void **)&cu.DeviceGetCount},
        {"cuDeviceGet", (void **)&cu.DeviceGet},
        {"cuDeviceGetAttribute", (void **)&cu.DeviceGetAttribute},
        {"cuDeviceGetName", (void **)&cu.DeviceGetName},
        {"cuCtxGetCurrent", (void **)&cu.CtxGetCurrent},
        {"cuCtxSetCurrent", (void **)&cu.CtxSetCurrent},
        {"cuCtxGetDevice", (void **)&cu.CtxGetDevice},
        {"cuDevicePrimaryCtxRetain", (void **)&cu.DevicePrimaryCtxRetain},
        {"cuModuleLoadData", (void **)&cu.ModuleLoadData},
        {"cuModuleGetFunction", (void **)&cu.ModuleGetFunction},
        {"cuFuncSetAttribute", (void **)&cu.FuncSetAttribute},
        {"cuTensorMapEncodeTiled", (void **)&cu.TensorMapEncodeTiled},
        {"cuLaunchKernel", (void **)&cu.LaunchKernel},
        {"cuEventCreate", (void **)&cu.EventCreate},
        {"cuEventDestroy", (void **)&cu.EventDestroy},
        {"cuEventRecord", (void **)&cu.EventRecord},
        {"cuStreamWaitEvent", (void **)&cu.StreamWaitEvent},
        {"cuGetErrorString", (void **)&cu.GetErrorString},
        {"cuGetErrorName", (void **)&cu.GetErrorName},
    };
    /* Error helpers first, so a later failure can be described. */
    cu.GetErrorString = (PFN_cuGetErrorString)dlsym(lib, "cuGetErrorString");
    cu.GetErrorName = (PFN_cuGetErrorName)dlsym(lib, "cuGetErrorName");
    const char *missing = NULL;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        *table[i].slot = resolve(lib, gpa, gpa_v2, table[i].name);
        if (*table[i].slot == NULL && missing == NULL) missing = table[i].name;
    }
    if (missing != NULL) {
        int version = 0;
        if (cu.DriverGetVersion == NULL || cu.DriverGetVersion(&version) != CUDA_SUCCESS) version = 0;
        memset(&cu, 0, sizeof cu);
        dlclose(lib);
        char detail[256];
        snprintf(detail, sizeof detail, "%s does not provide %s", path, missing);
        PyObject *cls = errors_attr("DriverTooOldError");
        raise_instance(cls, Py_BuildValue("(iis)", FQ_NEEDED_DRIVER_API, version, detail));
        return -1;
    }
    snprintf(g_lib_path, sizeof g_lib_path, "%s", path);
    g_lib = lib;
    return 0;
}

static int ensure_driver(void) {
    if (g_lib != NULL) return 0;
    pthread_mutex_lock(&g_lock);
    int rc = load_driver_locked();
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Caller holds g_lock. */
static int init_locked(void) {
    if (g_initialised) return 0;
    if (load_driver_locked() < 0) return -1;
    CUresult rc = cu.Init(0);
    if (rc != CUDA_SUCCESS) {
        raise_cu(rc, "cuInit(0) failed (%s)", g_lib_path);
        return -1;
    }
    g_initialised = 1;
    return 0;
}

static int ensure_init(void) {
    if (g_initialised) return 0;
    pthread_mutex_lock(&g_lock);
    int rc = init_locked();
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Caller holds g_lock and has initialised. */
static int get_device_locked(int ordinal, CUdevice *dev) {
    CUresult rc = cu.DeviceGet(dev, ordinal);
    if (rc != CUDA_SUCCESS) {
        raise_cu(rc, "cuDeviceGet(%d) failed", ordinal);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------ */
/* Context bookkeeping: modules and functions remember the context they live in. */

#define MAX_DEVICES 64
static CUcontext g_primary[MAX_DEVICES];

typedef struct { void *handle; CUcontext ctx; int smem_set; int carveout_set; } HandleCtx;
static HandleCtx *g_modules = NULL, *g_functions = NULL;
static size_t g_n_modules = 0, g_cap_modules = 0, g_n_functions = 0, g_cap_functions = 0;

static int remember(HandleCtx **arr, size_t *n, size_t *cap, void *handle, CUcontext ctx) {
    for (size_t i = 0; i < *n; i++)
        if ((*arr)[i].handle == handle) { (*arr)[i].ctx = ctx; return 0; }
    if (*n == *cap) {
        size_t ncap = *cap ? *cap * 2 : 64;
        HandleCtx *p = (HandleCtx *)realloc(*arr, ncap * sizeof(HandleCtx));
        if (p == NULL) { PyErr_NoMemory(); return -1; }
        *arr = p;
        *cap = ncap;
    }
    (*arr)[*n].handle = handle;
    (*arr)[*n].ctx = ctx;
    (*arr)[*n].smem_set = 0;
    (*arr)[*n].carveout_set = 0;
    (*n)++;
    return 0;
}

static HandleCtx *lookup(HandleCtx *arr, size_t n, void *handle) {
    for (size_t i = 0; i < n; i++)
        if (arr[i].handle == handle) return &arr[i];
    return NULL;
}

/* Make a context on `dev` current; *prev receives the context to restore. Caller holds g_lock. */
static int bind_device_locked(int ordinal, CUdevice dev, CUcontext *ctx_out, CUcontext *prev) {
    CUresult rc;
    CUcontext cur = NULL;
    rc = cu.CtxGetCurrent(&cur);
    if (rc != CUDA_SUCCESS) { raise_cu(rc, "cuCtxGetCurrent failed"); return -1; }
    *prev = cur;
    if (cur != NULL) {
        CUdevice cur_dev = -1;
        if (cu.CtxGetDevice(&cur_dev) == CUDA_SUCCESS && cur_dev == dev) {
            *ctx_out = cur;
            return 0;
        }
    }
    CUcontext primary = (ordinal >= 0 && ordinal < MAX_DEVICES) ? g_primary[ordinal] : NULL;
    if (primary == NULL) {
        rc = cu.DevicePrimaryCtxRetain(&primary, dev);
        if (rc != CUDA_SUCCESS) {
            raise_cu(rc, "cuDevicePrimaryCtxRetain(device %d) failed", ordinal);
            return -1;
        }
        if (ordinal >= 0 && ordinal < MAX_DEVICES) g_primary[ordinal] = primary; /* kept for the process */
    }
    rc = cu.CtxSetCurrent(primary);
    if (rc != CUDA_SUCCESS) {
        raise_cu(rc, "cuCtxSetCurrent(primary context of device %d) failed", ordinal);
        return -1;
    }
    *ctx_out = primary;
    return 0;
}

static void restore_ctx(CUcontext prev, CUcontext now) {
    if (prev != now) cu.CtxSetCurrent(prev);
}

/* ------------------------------------------------------------------------------------------------------ */
/* Device queries */

static PyObject *py_driver_version(PyObject *self, PyObject *noargs) {
    if (ensure_driver() < 0) return NULL;
    int v = 0;
    CUresult rc = cu.DriverGetVersion(&v);
    if (rc != CUDA_SUCCESS) return raise_cu(rc, "cuDriverGetVersion failed");
    return PyLong_FromLong(v);
}

static PyObject *py_device_count(PyObject *self, PyObject *noargs) {
    if (ensure_init() < 0) return NULL;
    int n = 0;
    CUresult rc = cu.DeviceGetCount(&n);
    if (rc != CUDA_SUCCESS) return raise_cu(rc, "cuDeviceGetCount failed");
    return PyLong_FromLong(n);
}

static int parse_ordinal(PyObject *arg, int *ordinal) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v >= MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "device ordinal must be in [0, %d), got %ld", MAX_DEVICES, v);
        return -1;
    }
    *ordinal = (int)v;
    return 0;
}

/* Python int -> (ordinal, CUdevice), initialising the driver first; -1 with an exception set on failure. */
static int resolve_device(PyObject *arg, int *ordinal, CUdevice *dev) {
    if (parse_ordinal(arg, ordinal) < 0) return -1;
    if (ensure_init() < 0) return -1;
    pthread_mutex_lock(&g_lock);
    int ok = get_device_locked(*ordinal, dev);
    pthread_mutex_unlock(&g_lock);
    return ok;
}

static PyObject *py_device_capability(PyObject *self, PyObject *arg) {
    int ordinal;
    CUdevice dev;
    if (resolve_device(arg, &ordinal, &dev) < 0) return NULL;
    int major = 0, minor = 0;
    CUresult rc = cu.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
    if (rc == CUDA_SUCCESS) rc = cu.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
    if (rc != CUDA_SUCCESS) return raise_cu(rc, "cuDeviceGetAttribute(compute capability, device %d) failed", ordinal);
    return Py_BuildValue("(ii)", major, minor);
}

static PyObject *py_device_name(PyObject *self, PyObject *arg) {
    int ordinal;
    CUdevice dev;
    if (resolve_device(arg, &ordinal, &dev) < 0) return NULL;
    char name[256];
    memset(name, 0, sizeof name);
    CUresult rc = cu.DeviceGetName(name, (int)sizeof name - 1, dev);
    if (rc != CUDA_SUCCESS) return raise_cu(rc, "cuDeviceGetName(device %d) failed", ordinal);
    return PyUnicode_FromString(name);
}

static PyObject *py_libcuda_path(PyObject *self, PyObject *noargs) {
    if (g_lib == NULL) Py_RETURN_NONE;
    return PyUnicode_FromString(g_lib_path);
}

/* ------------------------------------------------------------------------------------------------------ */
/* Modules and functions */

static PyObject *py_load_module(PyObject *self, PyObject *args) {
    int ordinal;
    const char *image;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "iy#:load_module", &ordinal, &image, &len)) return NULL;
    if (ordinal < 0 || ordinal >= MAX_DEVICES)
        return PyErr_Format(PyExc_ValueError, "device ordinal must be in [0, %d), got %d", MAX_DEVICES, ordinal);
    if (len == 0) return PyErr_Format(PyExc_ValueError, "load_module: empty cubin");
    PyObject *result = NULL;
    pthread_mutex_lock(&g_lock);
    if (init_locked() == 0) {
        CUdevice dev;
        CUcontext ctx = NULL, prev = NULL;
        if (get_device_locked(ordinal, &dev) == 0 && bind_device_locked(ordinal, dev, &ctx, &prev) == 0) {
            CUmodule mod = NULL;
            CUresult rc = cu.ModuleLoadData(&mod, image);
            restore_ctx(prev, ctx);
            if (rc != CUDA_SUCCESS) {
                raise_cu(rc, "cuModuleLoadData(%zd-byte cubin, device %d) failed", len, ordinal);
            } else if (remember(&g_modules, &g_n_modules, &g_cap_modules, mod, ctx) == 0) {
                result = PyLong_FromVoidPtr(mod);
            }
        }
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

static PyObject *py_get_function(PyObject *self, PyObject *args) {
    PyObject *mod_obj;
    const char *symbol;
    long long smem;
    int carveout = -1;
    if (!PyArg_ParseTuple(args, "OsL|i:get_function", &mod_obj, &symbol, &smem, &carveout)) return NULL;
    if (carveout < -1 || carveout > 100)
        return PyErr_Format(PyExc_ValueError, "get_function: bad shared-memory carveout %d (-1, or 0..100)", carveout);
    CUmodule mod = (CUmodule)PyLong_AsVoidPtr(mod_obj);
    if (mod == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "get_function: null module handle");
        return NULL;
    }
    if (smem < 0 || smem > INT32_MAX) return PyErr_Format(PyExc_ValueError, "get_function: bad smem %lld", smem);
    PyObject *result = NULL;
    pthread_mutex_lock(&g_lock);
    HandleCtx *m = g_initialised ? lookup(g_modules, g_n_modules, mod) : NULL;
    if (m == NULL) {
        PyErr_SetString(PyExc_ValueError, "get_function: unknown module handle (not from load_module)");
    } else {
        CUcontext prev = NULL;
        CUresult rc = cu.CtxGetCurrent(&prev);
        if (rc == CUDA_SUCCESS && prev != m->ctx) rc = cu.CtxSetCurrent(m->ctx);
        if (rc != CUDA_SUCCESS) {
            raise_cu(rc, "binding the module's context for cuModuleGetFunction(%s) failed", symbol);
        } else {
            CUfunction fn = NULL;
            rc = cu.ModuleGetFunction(&fn, mod, symbol);
            if (rc != CUDA_SUCCESS) {
                raise_cu(rc, "cuModuleGetFunction(\"%s\") failed", symbol);
            } else if (remember(&g_functions, &g_n_functions, &g_cap_functions, fn, m->ctx) == 0) {
                HandleCtx *f = lookup(g_functions, g_n_functions, fn);
                if (smem > FQ_DEFAULT_SMEM_LIMIT && f->smem_set < smem) {
                    rc = cu.FuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)smem);
                    if (rc != CUDA_SUCCESS)
                        raise_cu(rc, "cuFuncSetAttribute(%s, MAX_DYNAMIC_SHARED_SIZE_BYTES, %lld) failed", symbol,
                                 smem);
                    else
                        f->smem_set = (int)smem;
                }
                /* The manifest's shared-memory carveout (percent), for kernels meant to share SMs with another
                   kernel: an SM's L1 / shared split follows the kernel it runs, and a CTA that needs more shared
                   memory than that split cannot join the SM until it drains. */
                if (!PyErr_Occurred() && carveout >= 0 && f->carveout_set != carveout + 1) {
                    rc = cu.FuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, carveout);
                    if (rc != CUDA_SUCCESS)
                        raise_cu(rc, "cuFuncSetAttribute(%s, PREFERRED_SHARED_MEMORY_CARVEOUT, %d) failed", symbol,
                                 carveout);
                    else
                        f->carveout_set = carveout + 1;
                }
                if (!PyErr_Occurred()) result = PyLong_FromVoidPtr(fn);
            }
            restore_ctx(prev, m->ctx);
        }
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

/* Make the context that owns `fn` current on this thread (for a thread that has none). 0 on success. */
static int bind_function_ctx(CUfunction fn) {
    pthread_mutex_lock(&g_lock);
    HandleCtx *f = lookup(g_functions, g_n_functions, fn);
    CUcontext ctx = f ? f->ctx : NULL;
    pthread_mutex_unlock(&g_lock);
    return (ctx != NULL && cu.CtxSetCurrent(ctx) == CUDA_SUCCESS) ? 0 : -1;
}

/* ------------------------------------------------------------------------------------------------------ */
/* Tensor-map cache: 4-way set associative, keyed on every argument of cuTensorMapEncodeTiled. */

typedef struct {
    uint64_t addr;
    uint64_t dims[5];
    uint64_t strides[4];
    uint32_t box[5];
    uint32_t estr[5];
    int32_t dtype, rank, interleave, swizzle, l2, oob;
} TMKey;

typedef struct {
    CUtensorMap map;
    TMKey key;
    int valid;
} TMEntry;

#define TM_SETS 128
#define TM_WAYS 4
static TMEntry g_tm[TM_SETS][TM_WAYS];
static unsigned char g_tm_next[TM_SETS];
static unsigned long long g_tm_hits = 0, g_tm_misses = 0;

static uint64_t tm_hash(const TMKey *k) {
    const uint64_t *w = (const uint64_t *)k;
    uint64_t h = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < sizeof(TMKey) / 8; i++) {
        h ^= w[i];
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 29;
    }
    return h ^ (h >> 32);
}

static int get_u64_seq(PyObject *seq, uint64_t *out, Py_ssize_t want, const char *what) {
    if (!PyTuple_Check(seq) && !PyList_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "tensormap %s must be a tuple or list", what);
        return -1;
    }
    Py_ssize_t n = PyTuple_Check(seq) ? PyTuple_Size(seq) : PyList_Size(seq);
    if (n != want) {
        PyErr_Format(PyExc_ValueError, "tensormap %s has %zd entries, rank needs %zd", what, n, want);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyTuple_Check(seq) ? PyTuple_GetItem(seq, i) : PyList_GetItem(seq, i);
        unsigned long long v = PyLong_AsUnsignedLongLong(o);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "tensormap %s[%zd] must be a non-negative integer", what, i);
            return -1;
        }
        out[i] = v;
    }
    return 0;
}

static int get_int_item(PyObject *tup, Py_ssize_t i, int32_t *out, const char *what) {
    long v = PyLong_AsLong(PyTuple_GetItem(tup, i));
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "tensormap %s must be an int", what);
        return -1;
    }
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "tensormap %s out of range", what);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

/* Parse the tensormap tuple of argument `idx` into `key`; the address item is read only when `addr_out` is NULL
   (a program's template gives (slot, offset) there instead: see program_new). 0 on success. */
static int parse_tensormap(PyObject *t, Py_ssize_t idx, TMKey *key, PyObject **addr_out) {
    if (!PyTuple_Check(t) || PyTuple_Size(t) != 11) {
        PyErr_Format(PyExc_TypeError,
                     "launch: argument %zd ('m') must be an 11-tuple (dtype, rank, address, dims, strides, box, "
                     "element_strides, interleave, swizzle, l2_promotion, oob_fill)", idx);
        return -1;
    }
    memset(key, 0, sizeof *key);
    uint64_t tmp[5];
    if (get_int_item(t, 0, &key->dtype, "dtype") < 0 || get_int_item(t, 1, &key->rank, "rank") < 0) return -1;
    if (key->rank < 1 || key->rank > 5) {
        PyErr_Format(PyExc_ValueError, "launch: argument %zd: tensormap rank must be 1..5, got %d", idx, key->rank);
        return -1;
    }
    PyObject *addr = PyTuple_GetItem(t, 2);
    if (addr_out != NULL) {
        *addr_out = addr;
    } else if (addr != Py_None) {
        key->addr = PyLong_AsUnsignedLongLong(addr);
        if (key->addr == (uint64_t)-1 && PyErr_Occurred()) return -1;
    }
    if (get_u64_seq(PyTuple_GetItem(t, 3), key->dims, key->rank, "dims") < 0) return -1;
    if (get_u64_seq(PyTuple_GetItem(t, 4), key->strides, key->rank - 1, "strides") < 0) return -1;
    if (get_u64_seq(PyTuple_GetItem(t, 5), tmp, key->rank, "box") < 0) return -1;
    for (int i = 0; i < key->rank; i++) key->box[i] = (uint32_t)tmp[i];
    if (get_u64_seq(PyTuple_GetItem(t, 6), tmp, key->rank, "element_strides") < 0) return -1;
    for (int i = 0; i < key->rank; i++) key->estr[i] = (uint32_t)tmp[i];
    if (get_int_item(t, 7, &key->interleave, "interleave") < 0 || get_int_item(t, 8, &key->swizzle, "swizzle") < 0 ||
        get_int_item(t, 9, &key->l2, "l2_promotion") < 0 || get_int_item(t, 10, &key->oob, "oob_fill") < 0)
        return -1;
    return 0;
}

/* The encoded map for `key` (cache-owned: copy it before the next encode). */
static const CUtensorMap *encode_cached(const TMKey *key_in, Py_ssize_t idx, CUfunction fn) {
    TMKey key = *key_in;
    uint64_t h = tm_hash(&key);
    TMEntry *set = g_tm[h % TM_SETS];
    for (int w = 0; w < TM_WAYS; w++) {
        if (set[w].valid && memcmp(&set[w].key, &key, sizeof key) == 0) {
            g_tm_hits++;
            return &set[w].map;
        }
    }
    unsigned way = g_tm_next[h % TM_SETS]++ % TM_WAYS;
    TMEntry *e = &set[way];
    e->valid = 0;
    CUresult rc = cu.TensorMapEncodeTiled(&e->map, key.dtype, (cuuint32_t)key.rank, (void *)(uintptr_t)key.addr,
                                          key.dims, key.strides, key.box, key.estr, key.interleave, key.swizzle,
                                          key.l2, key.oob);
    if (rc == CUDA_ERROR_INVALID_CONTEXT && bind_function_ctx(fn) == 0) {
        /* The encoder wants a current context; this thread had none: bind the kernel's and retry. */
        rc = cu.TensorMapEncodeTiled(&e->map, key.dtype, (cuuint32_t)key.rank, (void *)(uintptr_t)key.addr,
                                     key.dims, key.strides, key.box, key.estr, key.interleave, key.swizzle, key.l2,
                                     key.oob);
    }
    if (rc != CUDA_SUCCESS) {
        char dims[160] = "", box[120] = "";
        size_t o1 = 0, o2 = 0;
        for (int i = 0; i < key.rank; i++) {
            o1 += snprintf(dims + o1, sizeof dims - o1, "%s%llu", i ? "," : "", (unsigned long long)key.dims[i]);
            o2 += snprintf(box + o2, sizeof box - o2, "%s%u", i ? "," : "", key.box[i]);
        }
        raise_cu(rc, "cuTensorMapEncodeTiled(argument %zd: dtype %d, rank %d, address 0x%llx, dims [%s], box [%s], "
                     "swizzle %d) failed", idx, key.dtype, key.rank, (unsigned long long)key.addr, dims, box,
                 key.swizzle);
        return NULL;
    }
    e->key = key;
    e->valid = 1;
    g_tm_misses++;
    return &e->map;
}

static const CUtensorMap *tensormap_for(PyObject *t, Py_ssize_t idx, CUfunction fn) {
    TMKey key;
    if (parse_tensormap(t, idx, &key, NULL) < 0) return NULL;
    return encode_cached(&key, idx, fn);
}

static PyObject *py_tensormap_cache_info(PyObject *self, PyObject *noargs) {
    long entries = 0;
    for (int s = 0; s < TM_SETS; s++)
        for (int w = 0; w < TM_WAYS; w++) entries += g_tm[s][w].valid;
    return Py_BuildValue("(KKl)", g_tm_hits, g_tm_misses, entries);
}

static PyObject *py_clear_tensormap_cache(PyObject *self, PyObject *noargs) {
    memset(g_tm, 0, sizeof g_tm);
    memset(g_tm_next, 0, sizeof g_tm_next);
    g_tm_hits = g_tm_misses = 0;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------------------ */
/* launch */

#define MAX_PARAMS 128
#define MAX_TMAPS 32

static int get_dim3(PyObject *o, unsigned out[3], const char *what) {
    if (!PyTuple_Check(o) || PyTuple_Size(o) != 3) {
        PyErr_Format(PyExc_TypeError, "launch: %s must be a 3-tuple of ints", what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < 3; i++) {
        long v = PyLong_AsLong(PyTuple_GetItem(o, i));
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v < 0 || v > (long)UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "launch: %s[%zd] = %ld out of range", what, i, v);
            return -1;
        }
        out[i] = (unsigned)v;
    }
    return 0;
}

/* A scalar argument ('i', 'l', 'f') as the bits cuLaunchKernel reads, into *out. `what` names the caller in errors. */
static int parse_scalar(char kind, PyObject *a, uint64_t *out, const char *what, Py_ssize_t idx) {
    *out = 0;
    if (kind == 'f') {
        double d = PyFloat_AsDouble(a);
        if (d == -1.0 && PyErr_Occurred()) return -1;
        float x = (float)d;
        memcpy(out, &x, sizeof x);
        return 0;
    }
    long long v = PyLong_AsLongLong(a);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (kind == 'i') {
        if (v < INT32_MIN || v > INT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "%s: argument %zd ('i') = %lld does not fit int32", what, idx, v);
            return -1;
        }
        int32_t x = (int32_t)v;
        memcpy(out, &x, sizeof x);
    } else {
        memcpy(out, &v, sizeof v);
    }
    return 0;
}

static PyObject *py_launch(PyObject *self, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError,
                     "launch(function, grid, block, smem, stream, signature, args) takes 7 arguments, got %zd", nargs);
        return NULL;
    }
    if (g_initialised == 0) {
        PyErr_SetString(PyExc_RuntimeError, "launch: the driver is not initialised (load a module first)");
        return NULL;
    }
    CUfunction fn = (CUfunction)PyLong_AsVoidPtr(argv[0]);
    if (fn == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "launch: null function handle");
        return NULL;
    }
    unsigned grid[3], block[3];
    if (get_dim3(argv[1], grid, "grid") < 0 || get_dim3(argv[2], block, "block") < 0) return NULL;
    long smem = PyLong_AsLong(argv[3]);
    if (smem == -1 && PyErr_Occurred()) return NULL;
    if (smem < 0 || smem > INT32_MAX) return PyErr_Format(PyExc_ValueError, "launch: bad smem %ld", smem);
    CUstream stream = NULL;
    if (argv[4] != Py_None) {
        stream = (CUstream)PyLong_AsVoidPtr(argv[4]);
        if (stream == NULL && PyErr_Occurred()) return NULL;
    }
    const char *sig;
    Py_ssize_t nsig;
    if (PyBytes_Check(argv[5])) {
        if (PyBytes_AsStringAndSize(argv[5], (char **)&sig, &nsig) < 0) return NULL;
    } else {
        sig = PyUnicode_AsUTF8AndSize(argv[5], &nsig);
        if (sig == NULL) return NULL;
    }
    PyObject *args = argv[6];
    int is_tuple = PyTuple_Check(args);
    if (!is_tuple && !PyList_Check(args)) {
        PyErr_SetString(PyExc_TypeError, "launch: args must be a tuple or list");
        return NULL;
    }
    Py_ssize_t nparams = is_tuple ? PyTuple_Size(args) : PyList_Size(args);
    if (nparams != nsig) {
        return PyErr_Format(PyExc_ValueError, "launch: signature has %zd parameters but %zd args were given", nsig,
                            nparams);
    }
    if (nparams > MAX_PARAMS) return PyErr_Format(PyExc_ValueError, "launch: too many parameters (%zd)", nparams);

    uint64_t scalars[MAX_PARAMS];
    CUtensorMap maps[MAX_TMAPS]; /* copies: a later cache eviction in this call cannot clobber them */
    void *params[MAX_PARAMS];
    int nmaps = 0;
    for (Py_ssize_t i = 0; i < nparams; i++) {
        PyObject *a = is_tuple ? PyTuple_GetItem(args, i) : PyList_GetItem(args, i);
        switch (sig[i]) {
        case 'p': {
            uint64_t v = 0;
            if (a != Py_None) {
                v = PyLong_AsUnsignedLongLong(a);
                if (v == (uint64_t)-1 && PyErr_Occurred()) {
                    PyErr_Clear();
                    return PyErr_Format(PyExc_TypeError, "launch: argument %zd ('p') must be a non-negative int "
                                        "pointer or None", i);
                }
            }
            scalars[i] = v;
            params[i] = &scalars[i];
            break;
        }
        case 'i':
        case 'l':
        case 'f':
            if (parse_scalar(sig[i], a, &scalars[i], "launch", i) < 0) return NULL;
            params[i] = &scalars[i];
            break;
        case 'm': {
            if (nmaps == MAX_TMAPS) return PyErr_Format(PyExc_ValueError, "launch: too many tensor maps");
            const CUtensorMap *m = tensormap_for(a, i, fn);
            if (m == NULL) return NULL;
            maps[nmaps] = *m;
            params[i] = &maps[nmaps];
            nmaps++;
            break;
        }
        default:
            return PyErr_Format(PyExc_ValueError, "launch: bad signature character '%c' at %zd (want p/i/l/f/m)",
                                sig[i], i);
        }
    }
    if ((uint64_t)grid[0] * grid[1] * grid[2] == 0) Py_RETURN_NONE; /* empty problem: nothing to launch */
    /* A thread's first launch: threads torch starts (autograd's backward workers) often have no context
       current; bind the function's up front rather than let a launch fail (compute-sanitizer reports that). */
    static _Thread_local int t_ctx_checked = 0;
    if (!t_ctx_checked) {
        CUcontext cur = NULL;
        if (cu.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur == NULL) bind_function_ctx(fn);
        t_ctx_checked = 1;
    }
    CUresult rc = cu.LaunchKernel(fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], (unsigned)smem, stream,
                                  params, NULL);
    if (rc == CUDA_ERROR_INVALID_CONTEXT && bind_function_ctx(fn) == 0) {
        /* The calling thread has no (or another) context current: bind the function's and retry once. */
        rc = cu.LaunchKernel(fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], (unsigned)smem, stream,
                                 params, NULL);
    }
    if (rc != CUDA_SUCCESS)
        return raise_cu(rc, "cuLaunchKernel(grid (%u, %u, %u), block (%u, %u, %u), smem %ld, %zd params) failed",
                        grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, nparams);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------------------ */
/* programs: a plan's whole launch sequence, issued by one call from Python.
 *
 * program_new(ops, nslots, nstreams) fixes everything a plan knows ahead of the call (functions, grids, scalar
 * arguments, tensor-map shapes); program_run(program, streams, pointers) then fills in what changes per call: the
 * streams and the base addresses of the call's tensors. A pointer argument is (slot, byte offset) into `pointers`
 * or an absolute int; a tensor map's address likewise. A "join" op makes one stream wait for the work queued so far
 * on another (an event record + stream wait, which a CUDA graph capture turns into a fork / join). */

enum { OP_LAUNCH = 0, OP_JOIN = 1 };
#define MAX_SLOTS 64
#define MAX_STREAMS 8

typedef struct {
    int kind;
    CUfunction fn;
    unsigned grid[3], block[3], smem;
    int stream;       /* index into program_run's streams */
    int nparams;
    char *sig;
    uint64_t *value;  /* scalar bits ('i', 'l', 'f'); absolute address or offset ('p') */
    int *slot;        /* 'p': pointer slot, -1 for an absolute address; 'm': index into tm */
    int ntm;
    TMKey *tm;        /* addr holds the offset when tm_slot >= 0 */
    int *tm_slot;
    int src;          /* OP_JOIN: `stream` waits for `src` */
    CUevent ev;
} ProgOp;

typedef struct {
    int nops, nslots, nstreams;
    ProgOp *ops;
} Program;

static void program_free(Program *p) {
    if (p == NULL) return;
    for (int i = 0; i < p->nops; i++) {
        ProgOp *op = &p->ops[i];
        free(op->sig);
        free(op->value);
        free(op->slot);
        free(op->tm);
        free(op->tm_slot);
        if (op->ev != NULL && g_lib != NULL) cu.EventDestroy(op->ev);
    }
    free(p->ops);
    free(p);
}

static void program_capsule_free(PyObject *capsule) {
    program_free((Program *)PyCapsule_GetPointer(capsule, "flash_qla.program"));
}

/* An address template: an int (absolute; None is 0) or a (slot, offset) pair. */
static int parse_address(PyObject *o, int nslots, int *slot, uint64_t *value, int op_index, Py_ssize_t arg) {
    if (o == Py_None) {
        *slot = -1;
        *value = 0;
        return 0;
    }
    if (PyTuple_Check(o)) {
        if (PyTuple_Size(o) != 2) {
            PyErr_Format(PyExc_TypeError, "program op %d argument %zd: an address is an int or (slot, offset)",
                         op_index, arg);
            return -1;
        }
        long s = PyLong_AsLong(PyTuple_GetItem(o, 0));
        if (s == -1 && PyErr_Occurred()) return -1;
        if (s < 0 || s >= nslots) {
            PyErr_Format(PyExc_ValueError, "program op %d argument %zd: pointer slot %ld outside 0..%d", op_index,
                         arg, s, nslots - 1);
            return -1;
        }
        unsigned long long off = PyLong_AsUnsignedLongLong(PyTuple_GetItem(o, 1));
        if (off == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        *slot = (int)s;
        *value = off;
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *slot = -1;
    *value = v;
    return 0;
}

static int parse_launch_op(PyObject *item, ProgOp *op, int nslots, int nstreams, int index) {
    /* ("launch", function, grid, block, smem, stream, signature, args) */
    if (PyTuple_Size(item) != 8) {
        PyErr_Format(PyExc_TypeError, "program op %d: a launch is (\"launch\", function, grid, block, smem, stream, "
                     "signature, args)", index);
        return -1;
    }
    op->fn = (CUfunction)PyLong_AsVoidPtr(PyTuple_GetItem(item, 1));
    if (op->fn == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "program op %d: null function handle", index);
        return -1;
    }
    if (get_dim3(PyTuple_GetItem(item, 2), op->grid, "grid") < 0 ||
        get_dim3(PyTuple_GetItem(item, 3), op->block, "block") < 0)
        return -1;
    long smem = PyLong_AsLong(PyTuple_GetItem(item, 4));
    if (smem == -1 && PyErr_Occurred()) return -1;
    if (smem < 0 || smem > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "program op %d: bad smem %ld", index, smem);
        return -1;
    }
    op->smem = (unsigned)smem;
    long stream = PyLong_AsLong(PyTuple_GetItem(item, 5));
    if (stream == -1 && PyErr_Occurred()) return -1;
    if (stream < 0 || stream >= nstreams) {
        PyErr_Format(PyExc_ValueError, "program op %d: stream index %ld outside 0..%d", index, stream, nstreams - 1);
        return -1;
    }
    op->stream = (int)stream;
    PyObject *sigobj = PyTuple_GetItem(item, 6);
    const char *sig;
    Py_ssize_t nsig;
    if (PyBytes_Check(sigobj)) {
        if (PyBytes_AsStringAndSize(sigobj, (char **)&sig, &nsig) < 0) return -1;
    } else {
        sig = PyUnicode_AsUTF8AndSize(sigobj, &nsig);
        if (sig == NULL) return -1;
    }
    PyObject *args = PyTuple_GetItem(item, 7);
    if (!PyTuple_Check(args) || PyTuple_Size(args) != nsig) {
        PyErr_Format(PyExc_ValueError, "program op %d: args must be a tuple of %zd items (one per signature char)",
                     index, nsig);
        return -1;
    }
    if (nsig > MAX_PARAMS) {
        PyErr_Format(PyExc_ValueError, "program op %d: too many parameters (%zd)", index, nsig);
        return -1;
    }
    op->nparams = (int)nsig;
    op->sig = malloc((size_t)nsig + 1);
    op->value = calloc((size_t)nsig + 1, sizeof *op->value);
    op->slot = calloc((size_t)nsig + 1, sizeof *op->slot);
    op->tm = calloc(MAX_TMAPS, sizeof *op->tm);
    op->tm_slot = calloc(MAX_TMAPS, sizeof *op->tm_slot);
    if (!op->sig || !op->value || !op->slot || !op->tm || !op->tm_slot) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(op->sig, sig, (size_t)nsig);
    for (Py_ssize_t i = 0; i < nsig; i++) {
        PyObject *a = PyTuple_GetItem(args, i);
        switch (sig[i]) {
        case 'p':
            if (parse_address(a, nslots, &op->slot[i], &op->value[i], index, i) < 0) return -1;
            break;
        case 'i':
        case 'l':
        case 'f':
            if (parse_scalar(sig[i], a, &op->value[i], "program_new", i) < 0) return -1;
            break;
        case 'm': {
            if (op->ntm == MAX_TMAPS) {
                PyErr_Format(PyExc_ValueError, "program op %d: too many tensor maps", index);
                return -1;
            }
            PyObject *addr = NULL;
            TMKey *key = &op->tm[op->ntm];
            if (parse_tensormap(a, i, key, &addr) < 0) return -1;
            if (parse_address(addr, nslots, &op->tm_slot[op->ntm], &key->addr, index, i) < 0) return -1;
            op->slot[i] = op->ntm++;
            break;
        }
        default:
            PyErr_Format(PyExc_ValueError, "program op %d: bad signature character '%c' at %zd (want p/i/l/f/m)",
                         index, sig[i], i);
            return -1;
        }
    }
    return 0;
}

static PyObject *py_program_new(PyObject *self, PyObject *args) {
    PyObject *ops;
    int nslots, nstreams;
    if (!PyArg_ParseTuple(args, "Oii:program_new", &ops, &nslots, &nstreams)) return NULL;
    if (!PyList_Check(ops) && !PyTuple_Check(ops)) {
        PyErr_SetString(PyExc_TypeError, "program_new: ops must be a list or tuple");
        return NULL;
    }
    if (nslots < 0 || nslots > MAX_SLOTS || nstreams < 1 || nstreams > MAX_STREAMS)
        return PyErr_Format(PyExc_ValueError, "program_new: %d pointer slots (0..%d) and %d streams (1..%d)", nslots,
                            MAX_SLOTS, nstreams, MAX_STREAMS);
    if (ensure_init() < 0) return NULL;
    PyObject *seq = PySequence_Tuple(ops);
    if (seq == NULL) return NULL;
    Py_ssize_t n = PyTuple_Size(seq);
    Program *p = calloc(1, sizeof *p);
    if (p != NULL) p->ops = calloc((size_t)(n > 0 ? n : 1), sizeof *p->ops);
    if (p == NULL || p->ops == NULL) {
        free(p);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    p->nslots = nslots;
    p->nstreams = nstreams;
    CUfunction first_fn = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GetItem(seq, i);
        ProgOp *op = &p->ops[i];
        p->nops = (int)i + 1;
        const char *kind = NULL;
        if (PyTuple_Check(item) && PyTuple_Size(item) >= 1 && PyUnicode_Check(PyTuple_GetItem(item, 0)))
            kind = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(item, 0), NULL);
        if (kind != NULL && strcmp(kind, "launch") == 0) {
            op->kind = OP_LAUNCH;
            if (parse_launch_op(item, op, nslots, nstreams, (int)i) < 0) goto fail;
            if (first_fn == NULL) first_fn = op->fn;
        } else if (kind != NULL && strcmp(kind, "join") == 0 && PyTuple_Size(item) == 3) {
            op->kind = OP_JOIN;
            long dst = PyLong_AsLong(PyTuple_GetItem(item, 1)), src = PyLong_AsLong(PyTuple_GetItem(item, 2));
            if (PyErr_Occurred()) goto fail;
            if (dst < 0 || dst >= nstreams || src < 0 || src >= nstreams || dst == src) {
                PyErr_Format(PyExc_ValueError, "program op %zd: join streams %ld <- %ld outside 0..%d or equal", i,
                             dst, src, nstreams - 1);
                goto fail;
            }
            op->stream = (int)dst;
            op->src = (int)src;
        } else {
            PyErr_Format(PyExc_TypeError, "program op %zd: expected (\"launch\", ...) or (\"join\", dst, src)", i);
            goto fail;
        }
    }
    /* Events must share a context with the streams they join: the program's kernels' context (its device's, as
       the streams are), whatever context this thread has current; the thread's own is restored after. */
    CUcontext prev = NULL, own = NULL;
    if (first_fn != NULL) {
        pthread_mutex_lock(&g_lock);
        HandleCtx *f = lookup(g_functions, g_n_functions, first_fn);
        own = f ? f->ctx : NULL;
        pthread_mutex_unlock(&g_lock);
    }
    int bound = own != NULL && cu.CtxGetCurrent(&prev) == CUDA_SUCCESS && (prev == own || cu.CtxSetCurrent(own) == 0);
    for (int i = 0; i < p->nops; i++) {
        ProgOp *op = &p->ops[i];
        if (op->kind != OP_JOIN) continue;
        CUresult rc = cu.EventCreate(&op->ev, 2 /* CU_EVENT_DISABLE_TIMING */);
        if (rc != CUDA_SUCCESS) {
            op->ev = NULL;
            if (bound) restore_ctx(prev, own);
            raise_cu(rc, "cuEventCreate for program op %d failed", i);
            goto fail;
        }
    }
    if (bound) restore_ctx(prev, own);
    Py_DECREF(seq);
    PyObject *capsule = PyCapsule_New(p, "flash_qla.program", program_capsule_free);
    if (capsule == NULL) program_free(p);
    return capsule;
fail:
    Py_DECREF(seq);
    program_free(p);
    return NULL;
}

static int get_u64_tuple(PyObject *o, uint64_t *out, int want, const char *what) {
    if (!PyTuple_Check(o) || PyTuple_Size(o) != want) {
        PyErr_Format(PyExc_TypeError, "program_run: %s must be a tuple of %d ints", what, want);
        return -1;
    }
    for (int i = 0; i < want; i++) {
        PyObject *a = PyTuple_GetItem(o, i);
        if (a == Py_None) {
            out[i] = 0;
            continue;
        }
        unsigned long long v = PyLong_AsUnsignedLongLong(a);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        out[i] = v;
    }
    return 0;
}

static PyObject *py_program_run(PyObject *self, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "program_run(program, streams, pointers) takes 3 arguments, got %zd", nargs);
        return NULL;
    }
    Program *p = (Program *)PyCapsule_GetPointer(argv[0], "flash_qla.program");
    if (p == NULL) return NULL;
    uint64_t streams[MAX_STREAMS], ptrs[MAX_SLOTS];
    if (get_u64_tuple(argv[1], streams, p->nstreams, "streams") < 0 ||
        get_u64_tuple(argv[2], ptrs, p->nslots, "pointers") < 0)
        return NULL;
    static _Thread_local int t_ctx_checked = 0;
    for (int i = 0; i < p->nops; i++) {
        ProgOp *op = &p->ops[i];
        CUresult rc;
        if (op->kind == OP_JOIN) {
            rc = cu.EventRecord(op->ev, (CUstream)(uintptr_t)streams[op->src]);
            if (rc == CUDA_SUCCESS) rc = cu.StreamWaitEvent((CUstream)(uintptr_t)streams[op->stream], op->ev, 0);
            if (rc != CUDA_SUCCESS) return raise_cu(rc, "program op %d: joining stream %d to stream %d failed", i,
                                                    op->stream, op->src);
            continue;
        }
        uint64_t scalars[MAX_PARAMS];
        CUtensorMap maps[MAX_TMAPS];
        void *params[MAX_PARAMS];
        for (int j = 0; j < op->nparams; j++) {
            switch (op->sig[j]) {
            case 'p':
                scalars[j] = op->slot[j] >= 0 ? ptrs[op->slot[j]] + op->value[j] : op->value[j];
                params[j] = &scalars[j];
                break;
            case 'm': {
                int t = op->slot[j];
                TMKey key = op->tm[t];
                if (op->tm_slot[t] >= 0) key.addr += ptrs[op->tm_slot[t]];
                const CUtensorMap *m = encode_cached(&key, j, op->fn);
                if (m == NULL) return NULL;
                maps[t] = *m;
                params[j] = &maps[t];
                break;
            }
            default:
                scalars[j] = op->value[j];
                params[j] = &scalars[j];
            }
        }
        if ((uint64_t)op->grid[0] * op->grid[1] * op->grid[2] == 0) continue;
        if (!t_ctx_checked) {
            CUcontext cur = NULL;
            if (cu.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur == NULL) bind_function_ctx(op->fn);
            t_ctx_checked = 1;
        }
        CUstream stream = (CUstream)(uintptr_t)streams[op->stream];
        rc = cu.LaunchKernel(op->fn, op->grid[0], op->grid[1], op->grid[2], op->block[0], op->block[1], op->block[2],
                             op->smem, stream, params, NULL);
        if (rc == CUDA_ERROR_INVALID_CONTEXT && bind_function_ctx(op->fn) == 0)
            rc = cu.LaunchKernel(op->fn, op->grid[0], op->grid[1], op->grid[2], op->block[0], op->block[1],
                                 op->block[2], op->smem, stream, params, NULL);
        if (rc != CUDA_SUCCESS)
            return raise_cu(rc, "program op %d: cuLaunchKernel(grid (%u, %u, %u), block (%u, %u, %u), smem %u) failed",
                            i, op->grid[0], op->grid[1], op->grid[2], op->block[0], op->block[1], op->block[2],
                            op->smem);
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------------------ */

static PyMethodDef methods[] = {
    {"driver_version", py_driver_version, METH_NOARGS, "driver_version() -> int: cuDriverGetVersion (e.g. 13000)."},
    {"device_count", py_device_count, METH_NOARGS, "device_count() -> int"},
    {"device_capability", py_device_capability, METH_O, "device_capability(ordinal) -> (major, minor)"},
    {"device_name", py_device_name, METH_O, "device_name(ordinal) -> str"},
    {"libcuda_path", py_libcuda_path, METH_NOARGS, "libcuda_path() -> str | None: the driver library loaded"},
    {"load_module", py_load_module, METH_VARARGS,
     "load_module(ordinal, cubin: bytes) -> int: cuModuleLoadData in the current context when it is on that device, "
     "else in the device's primary context."},
    {"get_function", py_get_function, METH_VARARGS,
     "get_function(module, symbol, dyn_smem, carveout=-1) -> int: cuModuleGetFunction; sets the shared-memory carveout "
     "(percent) when carveout >= 0, and raises the max dynamic smem attribute "
     "once when dyn_smem > 48 KiB."},
    {"launch", (PyCFunction)(void (*)(void))py_launch, METH_FASTCALL,
     "launch(function, grid, block, smem, stream, signature, args) -> None: cuLaunchKernel on `stream`. "
     "signature: one char per parameter, p/i/l/f/m; a tensor map is (dtype, rank, address, dims, strides, box, "
     "element_strides, interleave, swizzle, l2_promotion, oob_fill)."},
    {"program_new", py_program_new, METH_VARARGS,
     "program_new(ops, nslots, nstreams) -> program: a launch sequence fixed ahead of its calls. ops: "
     "(\"launch\", function, grid, block, smem, stream_index, signature, args) with each pointer (and tensor-map "
     "address) an int or (slot, offset), or (\"join\", dst_stream_index, src_stream_index)."},
    {"program_run", (PyCFunction)(void (*)(void))py_program_run, METH_FASTCALL,
     "program_run(program, streams, pointers) -> None: issue the program's ops; streams and pointers are tuples of "
     "nstreams and nslots ints."},
    {"tensormap_cache_info", py_tensormap_cache_info, METH_NOARGS,
     "tensormap_cache_info() -> (hits, misses, entries)"},
    {"clear_tensormap_cache", py_clear_tensormap_cache, METH_NOARGS, "clear_tensormap_cache() -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_launcher",
    "flash_qla's zero-JIT launcher: dlopens libcuda.so.1 at first use, loads cubins, encodes tensor maps and "
    "launches kernels on the caller's stream.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__launcher(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    PyModule_AddIntConstant(m, "MAX_PARAMS", MAX_PARAMS);
    PyModule_AddIntConstant(m, "MAX_TENSORMAPS", MAX_TMAPS);
    PyModule_AddIntConstant(m, "LIMITED_API", Py_LIMITED_API);
    return m;
}
