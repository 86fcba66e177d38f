/* C API of the insitu-gs adaptor: an embedded Python interpreter running insitu.run.adaptor.Adaptor.
 *
 * The simulation's arrays are handed to Python without a copy (read-only memoryviews viewed
 * as numpy arrays); the Adaptor copies what it keeps before execute returns. Python errors
 * become return codes and a message for insitu_last_error(). The GIL is released between
 * calls so the Adaptor's background thread can train while the simulation runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "insitu_adaptor.h"

#include <mpi4py/mpi4py.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef INSITU_DEFAULT_PYTHON
#define INSITU_DEFAULT_PYTHON ""
#endif
#ifndef INSITU_DEFAULT_PYTHONPATH
#define INSITU_DEFAULT_PYTHONPATH ""
#endif

static PyObject *g_adaptor = NULL;       /* insitu.run.adaptor.Adaptor instance */
static char g_python[4096] = "";         /* the interpreter started, and what chose it (errors name both) */
static const char *g_chosen_by = NULL;   /* NULL: the host's own running Python */
static PyThreadState *g_main_thread = NULL;
static double g_origin[3] = {0.0, 0.0, 0.0};
static double g_spacing[3] = {1.0, 1.0, 1.0};
static char g_error[8192] = "";

static void set_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error, sizeof g_error, fmt, ap);
    va_end(ap);
}

const char *insitu_last_error(void) { return g_error; }

/* The pending Python exception as "Type: message" in g_error; clears it. GIL held. */
static int python_error(const char *where)
{
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    const char *tname = "Error", *msg = "(no message)";
    PyObject *str = value ? PyObject_Str(value) : NULL;
    if (type && PyType_Check(type))
        tname = ((PyTypeObject *)type)->tp_name;
    if (str)
        msg = PyUnicode_AsUTF8(str);
    if (!msg) {
        PyErr_Clear();
        msg = "(message not printable)";
    }
    const char *dot = strrchr(tname, '.');
    set_error("%s: %s: %s", where, dot ? dot + 1 : tname, msg);
    Py_XDECREF(str);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return INSITU_ERROR;
}

/* python_error() for a failed import: the message also names the interpreter started and what chose it
 * (a stale VIRTUAL_ENV, an INSITU_PYTHON that is no Python or another one than the environment's). GIL held. */
static int import_error(const char *where)
{
    int rc = python_error(where);
    if (g_chosen_by) {
        size_t used = strlen(g_error);
        snprintf(g_error + used, sizeof g_error - used,
                 " (in Python started as %s, chosen by %s: is it the python of the environment that holds "
                 "insitu-gs and mpi4py, of Python %d.%d? set INSITU_PYTHON to it, see adaptors/README.md)",
                 *g_python ? g_python : "the default", g_chosen_by, PY_MAJOR_VERSION, PY_MINOR_VERSION);
    }
    return rc;
}

/* Prepend the ':'-separated entries of `paths` to sys.path. GIL held. */
static int add_sys_path(const char *paths)
{
    if (!paths || !*paths)
        return 0;
    PyObject *sys_path = PySys_GetObject("path"); /* borrowed */
    if (!sys_path)
        return -1;
    char *copy = strdup(paths), *save = NULL;
    int pos = 0;
    for (char *p = strtok_r(copy, ":", &save); p; p = strtok_r(NULL, ":", &save)) {
        PyObject *entry = PyUnicode_DecodeFSDefault(p);
        if (!entry || PyList_Insert(sys_path, pos++, entry) < 0) {
            Py_XDECREF(entry);
            free(copy);
            return -1;
        }
        Py_DECREF(entry);
    }
    free(copy);
    return 0;
}

/* Start the interpreter once per process (unless the host already runs Python).
 * Interpreter: INSITU_PYTHON, else $VIRTUAL_ENV/bin/python, else the one the library was
 * built with; a venv's site-packages are found from its pyvenv.cfg, as for `python`.
 * Leaves the GIL released. */
static int start_python(void)
{
    if (Py_IsInitialized())
        return INSITU_OK;
    static char chosen_by[4200];
    const char *python = getenv("INSITU_PYTHON"), *venv = getenv("VIRTUAL_ENV");
    if (python && *python) {
        snprintf(chosen_by, sizeof chosen_by, "INSITU_PYTHON=%s", python);
        snprintf(g_python, sizeof g_python, "%s", python);
    } else if (venv && *venv) {
        snprintf(chosen_by, sizeof chosen_by, "VIRTUAL_ENV=%s", venv);
        snprintf(g_python, sizeof g_python, "%s/bin/python", venv);
    } else {
        snprintf(chosen_by, sizeof chosen_by, "the build's default (CMake's INSITU_PYTHON; no INSITU_PYTHON or "
                 "VIRTUAL_ENV set)");
        snprintf(g_python, sizeof g_python, "%s", INSITU_DEFAULT_PYTHON);
    }
    g_chosen_by = chosen_by;
    python = g_python;
    if (*python && access(python, X_OK) != 0) { /* else Python would start from its build's paths regardless */
        set_error("insitu_initialize: the Python interpreter %s, chosen by %s, %s; expected the python of the "
                  "environment that holds insitu-gs and mpi4py (set INSITU_PYTHON to it, see adaptors/README.md)",
                  python, chosen_by, errno == ENOENT ? "does not exist" : strerror(errno));
        return INSITU_ERROR_PYTHON;
    }

    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0; /* leave SIGINT & co. to the simulation */
    config.parse_argv = 0;
    PyStatus status = PyStatus_Ok();
    if (*python)
        status = PyConfig_SetBytesString(&config, &config.program_name, python);
    if (!PyStatus_Exception(status))
        status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
        set_error("insitu_initialize: could not start Python (interpreter %s, chosen by %s): %s",
                  *python ? python : "default", g_chosen_by, status.err_msg ? status.err_msg : "unknown error");
        return INSITU_ERROR_PYTHON;
    }
    int rc = INSITU_OK;
    if (add_sys_path(INSITU_DEFAULT_PYTHONPATH) < 0 || add_sys_path(getenv("INSITU_PYTHONPATH")) < 0)
        rc = python_error("insitu_initialize: sys.path");
    g_main_thread = PyEval_SaveThread();
    return rc;
}

/* The MPI library mpi4py uses must be the one this library (and the simulation) links, or a
 * communicator would cross between two MPIs. mpi4py takes an MPI already loaded in the
 * process first; compare the version strings to be sure. GIL held. */
static int check_same_mpi(void)
{
    char c_version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(c_version, &len);
    PyObject *mpi = PyImport_ImportModule("mpi4py.MPI");
    PyObject *v = mpi ? PyObject_CallMethod(mpi, "Get_library_version", NULL) : NULL;
    const char *py_version = v ? PyUnicode_AsUTF8(v) : NULL;
    int rc = INSITU_OK;
    if (!py_version) {
        rc = import_error("insitu_initialize: mpi4py.MPI.Get_library_version");
    } else if (strncmp(c_version, py_version, 64) != 0) {
        set_error("insitu_initialize: mpi4py uses another MPI library than the simulation:\n  C:      %.200s\n"
                  "  mpi4py: %.200s\nbuild mpi4py against this MPI (pip install --no-binary mpi4py mpi4py) "
                  "or link the simulation with the MPI of mpi4py", c_version, py_version);
        rc = INSITU_ERROR_PYTHON;
    }
    Py_XDECREF(v);
    Py_XDECREF(mpi);
    return rc;
}

static int initialize(MPI_Comm comm, const char *config_path)
{
    if (g_adaptor) {
        set_error("insitu_initialize: already initialised; call insitu_finalize first");
        return INSITU_ERROR_STATE;
    }
    int rc = start_python();
    if (rc != INSITU_OK)
        return rc;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *module = NULL, *cls = NULL, *pycomm = NULL, *path = NULL;
    if (import_mpi4py() < 0) {
        rc = import_error("insitu_initialize: import mpi4py");
        if (rc == INSITU_ERROR)
            rc = INSITU_ERROR_PYTHON;
        goto done;
    }
    if (check_same_mpi() != INSITU_OK) {
        rc = INSITU_ERROR_PYTHON;
        goto done;
    }
    module = PyImport_ImportModule("insitu.run.adaptor");
    if (!module) {
        import_error("insitu_initialize: import insitu.run.adaptor (set INSITU_PYTHONPATH?)");
        rc = INSITU_ERROR_PYTHON;
        goto done;
    }
    cls = PyObject_GetAttrString(module, "Adaptor");
    pycomm = PyMPIComm_New(comm);
    if (!cls || !pycomm) {
        rc = python_error("insitu_initialize");
        goto done;
    }
    if (config_path && *config_path) {
        path = PyUnicode_DecodeFSDefault(config_path);
    } else {
        path = Py_None;
        Py_INCREF(path);
    }
    g_adaptor = path ? PyObject_CallFunctionObjArgs(cls, pycomm, path, NULL) : NULL;
    if (!g_adaptor) {
        rc = python_error("insitu_initialize");
        goto done;
    }
    g_origin[0] = g_origin[1] = g_origin[2] = 0.0;
    g_spacing[0] = g_spacing[1] = g_spacing[2] = 1.0;
    g_error[0] = '\0';
done:
    Py_XDECREF(path);
    Py_XDECREF(pycomm);
    Py_XDECREF(cls);
    Py_XDECREF(module);
    PyGILState_Release(gil);
    return rc;
}

int insitu_initialize(MPI_Comm comm, const char *config_path) { return initialize(comm, config_path); }

int insitu_initialize_f(MPI_Fint comm, const char *config_path)
{
    return initialize(MPI_Comm_f2c(comm), config_path);
}

int insitu_set_geometry(const double origin[3], const double spacing[3])
{
    for (int a = 0; a < 3; a++) {
        if (spacing && !(spacing[a] > 0.0)) {
            set_error("insitu_set_geometry: spacing must be > 0 along x, y, z, got (%g, %g, %g)",
                      spacing[0], spacing[1], spacing[2]);
            return INSITU_ERROR;
        }
    }
    for (int a = 0; a < 3; a++) {
        if (origin)
            g_origin[a] = origin[a];
        if (spacing)
            g_spacing[a] = spacing[a];
    }
    return INSITU_OK;
}

static size_t dtype_size(int dtype)
{
    switch (dtype) {
    case INSITU_UINT8: case INSITU_INT8: return 1;
    case INSITU_UINT16: case INSITU_INT16: return 2;
    case INSITU_UINT32: case INSITU_INT32: case INSITU_FLOAT32: return 4;
    case INSITU_UINT64: case INSITU_INT64: case INSITU_FLOAT64: return 8;
    default: return 0; /* unknown: Python reports it, on every rank */
    }
}

static PyObject *triple_i(const int64_t v[3])
{
    if (!v)
        return PyTuple_Pack(0);
    return Py_BuildValue("(LLL)", (long long)v[0], (long long)v[1], (long long)v[2]);
}

int insitu_execute_fields(int step, double time, int nfields, const insitu_field *fields,
                          const int64_t global_dims[3], const int64_t start[3], const int64_t count[3])
{
    if (!g_adaptor) {
        set_error("insitu_execute: not initialised; call insitu_initialize first");
        return INSITU_ERROR_STATE;
    }
    int rc = INSITU_OK;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *list = PyList_New(0), *gd = triple_i(global_dims), *st = triple_i(start), *ct = triple_i(count);
    PyObject *result = NULL;
    if (!list || !gd || !st || !ct)
        goto fail;
    /* invalid arguments are passed on as None / empty / bytes / unknown so that Python rejects them
     * collectively: an error on one rank is reported on every rank, and no rank returns before the
     * others (a negative count, or one whose bytes overflow, gets an empty view: Python names the count) */
    Py_ssize_t n = 1; /* samples, 0 when a count is < 1 or their number overflows */
    for (int a = 0; a < 3 && count; a++)
        n = count[a] <= 0 || n == 0 || count[a] > PY_SSIZE_T_MAX / n ? 0 : n * (Py_ssize_t)count[a];
    for (int i = 0; i < nfields && fields; i++) {
        const insitu_field *f = &fields[i];
        size_t size = dtype_size(f->dtype);
        PyObject *name = f->name ? PyUnicode_FromString(f->name) : (Py_INCREF(Py_None), Py_None);
        if (!name && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear(); /* not UTF-8: its bytes, which Python refuses naming them */
            name = PyBytes_FromString(f->name);
        }
        PyObject *view = f->data && size
                             ? PyMemoryView_FromMemory((char *)f->data,
                                                       n > PY_SSIZE_T_MAX / (Py_ssize_t)size ? 0 : n * (Py_ssize_t)size,
                                                       PyBUF_READ)
                             : (Py_INCREF(Py_None), Py_None);
        PyObject *item = (name && view) ? Py_BuildValue("(OOi)", name, view, f->dtype) : NULL;
        Py_XDECREF(name);
        Py_XDECREF(view);
        if (!item || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            goto fail;
        }
        Py_DECREF(item);
    }
    result = PyObject_CallMethod(g_adaptor, "execute_buffers", "idOOOO(ddd)(ddd)", step, time, list, gd, st,
                                 ct, g_origin[0], g_origin[1], g_origin[2], g_spacing[0], g_spacing[1],
                                 g_spacing[2]);
    if (!result)
        goto fail;
    goto done;
fail:
    rc = python_error("insitu_execute");
done:
    Py_XDECREF(result);
    Py_XDECREF(list);
    Py_XDECREF(gd);
    Py_XDECREF(st);
    Py_XDECREF(ct);
    PyGILState_Release(gil);
    return rc;
}

int insitu_execute(int step, double time, const char *name, const void *data, int dtype,
                   const int64_t global_dims[3], const int64_t start[3], const int64_t count[3])
{
    insitu_field field = {name, data, dtype};
    return insitu_execute_fields(step, time, 1, &field, global_dims, start, count);
}

static int finalize(int drain)
{
    if (!g_adaptor) {
        set_error("insitu_finalize: not initialised");
        return INSITU_ERROR_STATE;
    }
    int rc = INSITU_OK;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *result = PyObject_CallMethod(g_adaptor, "finalize", "(O)", drain ? Py_True : Py_False);
    if (!result)
        rc = python_error("insitu_finalize");
    Py_XDECREF(result);
    Py_CLEAR(g_adaptor);
    PyGILState_Release(gil);
    return rc;
}

int insitu_finalize(void) { return finalize(1); }

int insitu_finalize_discard(void) { return finalize(0); }
