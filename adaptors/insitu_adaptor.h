/* insitu-gs simulation adaptor: train Gaussian splatting models of a running simulation's
 * isosurfaces in situ, from C, C++ or Fortran.
 *
 *     MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
 *     if (insitu_initialize(MPI_COMM_WORLD, "gs.yaml") != INSITU_OK)
 *         fprintf(stderr, "%s\n", insitu_last_error());
 *     for (step = 0; ...; step++) {
 *         advance(...);
 *         insitu_execute(step, t, "U", u, INSITU_FLOAT64, global_dims, start, count);
 *     }
 *     insitu_finalize();
 *     MPI_Finalize();
 *
 * Every function is collective over the communicator given to insitu_initialize: all ranks
 * call it, in the same order. Arrays are this rank's block of the global grid, without ghost
 * layers, x varying fastest (C: data[z][y][x]; Fortran: a(x, y, z)); the blocks of all ranks
 * tile the grid. global_dims, start and count are (x, y, z); start is 0-based.
 *
 * Errors: every function returns INSITU_OK (0) or a non-zero code; insitu_last_error() then
 * says why. A failure on one rank (bad input, a Python exception, a failed training step)
 * is agreed collectively, so every rank returns the error from the same call. The
 * simulation is never aborted by the adaptor.
 *
 * Training runs in a background thread (run.mode: background in the config) when MPI
 * provides MPI_THREAD_MULTIPLE; otherwise every execute trains before returning.
 * The adaptor embeds Python (see adaptors/README.md for INSITU_PYTHON, VIRTUAL_ENV and
 * INSITU_PYTHONPATH). The interpreter stays alive after insitu_finalize() until the process
 * ends; insitu_initialize() may be called again after insitu_finalize().
 */
#ifndef INSITU_ADAPTOR_H
#define INSITU_ADAPTOR_H

#include <mpi.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define INSITU_ADAPTOR_VERSION_MAJOR 0
#define INSITU_ADAPTOR_VERSION_MINOR 1
#define INSITU_ADAPTOR_VERSION_PATCH 0

/* Element types of the fields (the codes of insitu.run.adaptor.C_DTYPES). */
enum insitu_dtype {
    INSITU_UINT8 = 1,
    INSITU_INT8 = 2,
    INSITU_UINT16 = 3,
    INSITU_INT16 = 4,
    INSITU_UINT32 = 5,
    INSITU_INT32 = 6,
    INSITU_UINT64 = 7,
    INSITU_INT64 = 8,
    INSITU_FLOAT32 = 9,
    INSITU_FLOAT64 = 10
};

/* Return codes. */
enum insitu_status {
    INSITU_OK = 0,
    INSITU_ERROR = 1,        /* the step, the input or the configuration failed (on some rank) */
    INSITU_ERROR_STATE = 2,  /* called before insitu_initialize / initialised twice */
    INSITU_ERROR_PYTHON = 3  /* Python could not be started or the insitu package not imported */
};

/* One field of a multi-field execute. */
typedef struct insitu_field {
    const char *name;  /* e.g. "U" */
    const void *data;  /* count[0] * count[1] * count[2] values, x fastest */
    int dtype;         /* enum insitu_dtype */
} insitu_field;

/* Start the adaptor on comm (duplicated, never used directly). config_path: a YAML file,
 * or NULL / "" for the defaults. A missing or invalid configuration fails here. */
int insitu_initialize(MPI_Comm comm, const char *config_path);

/* World position of global sample (0, 0, 0) and size of one cell, (x, y, z); used by the
 * next executes (default: origin 0, spacing 1). Local, not collective. */
int insitu_set_geometry(const double origin[3], const double spacing[3]);

/* Hand one timestep of one field to the pipeline. The data is copied (or trained on, in
 * sync mode) before the call returns; the simulation may overwrite it right after. */
int insitu_execute(int step, double time, const char *name, const void *data, int dtype,
                   const int64_t global_dims[3], const int64_t start[3], const int64_t count[3]);

/* Several fields of the same block at once, e.g. U (isosurface) and V (colour). */
int insitu_execute_fields(int step, double time, int nfields, const insitu_field *fields,
                          const int64_t global_dims[3], const int64_t start[3], const int64_t count[3]);

/* Train the steps still waiting, stop the worker, release the communicators. Returns an
 * error if a step failed on any rank. */
int insitu_finalize(void);

/* Like insitu_finalize, but steps still waiting in the queue are dropped, not trained. */
int insitu_finalize_discard(void);

/* The message of the last error on this rank ("" if none); valid until the next call. */
const char *insitu_last_error(void);

/* For the Fortran module: insitu_initialize with a Fortran communicator handle. */
int insitu_initialize_f(MPI_Fint comm, const char *config_path);

#ifdef __cplusplus
}
#endif

#endif /* INSITU_ADAPTOR_H */
