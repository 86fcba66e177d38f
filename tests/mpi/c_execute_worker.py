"""The C API's insitu_execute with arguments C cannot check, called through ctypes from this Python (the library
then uses the running interpreter): a negative count, a count whose bytes overflow, a field name that is not
UTF-8. Only rank 1 passes the bad argument: every rank must return the error from the same call (none returns
before the others, none waits). Prints each case's return code and insitu_last_error() per rank, as JSON lines.

    python c_execute_worker.py LIBRARY CONFIG.yaml
"""
import ctypes
import json
import sys

import numpy as np
from mpi4py import MPI

lib = ctypes.CDLL(sys.argv[1])
lib.insitu_last_error.restype = ctypes.c_char_p
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
assert MPI._sizeof(MPI.Comm) == ctypes.sizeof(ctypes.c_int), "MPICH's MPI_Comm is an int"
rc = lib.insitu_initialize(ctypes.c_int(MPI._handleof(comm)), sys.argv[2].encode())
assert rc == 0, lib.insitu_last_error()
triple = ctypes.c_int64 * 3
u = np.zeros((4, 4, 4), np.float32)
cases = {"negative count": (b"U", (4, 4, -5)), "huge count": (b"U", (2**21,) * 3),
         "non-UTF-8 name": (b"U\xff", (4, 4, 4))}
for step, (case, (name, count)) in enumerate(cases.items()):
    if rank != 1:
        name, count = b"U", (4, 4, 4)
    rc = lib.insitu_execute(step, ctypes.c_double(0.0), name, u.ctypes.data_as(ctypes.c_void_p), 9,
                            triple(4, 4, 4 * comm.Get_size()), triple(0, 0, 4 * rank), triple(*count))
    print(json.dumps({"rank": rank, "case": case, "rc": rc, "error": lib.insitu_last_error().decode()}), flush=True)
assert lib.insitu_finalize() == 0, lib.insitu_last_error()
