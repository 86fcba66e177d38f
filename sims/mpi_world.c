/* MPI start and end for sims/sphere.f90 through the C MPI library, so that the Fortran
 * example builds against an MPI without Fortran bindings (such as the mpich wheel). */
#include <mpi.h>
#include <stddef.h>

/* MPI_Init_thread at MPI_THREAD_MULTIPLE (background training needs it); returns the
 * Fortran handle of MPI_COMM_WORLD, and this rank and the number of ranks in it. */
int world_init(int *rank, int *nranks)
{
    int provided;
    MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, nranks);
    return (int)MPI_Comm_c2f(MPI_COMM_WORLD);
}

void world_finalize(void) { MPI_Finalize(); }
