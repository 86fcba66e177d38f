/* Gray-Scott reaction-diffusion in 3D with MPI, linked to the insitu-gs adaptor.
 *
 *   mpiexec -n 4 ./gray_scott_c [options]
 *     --L N          cube edge, samples (default 64)
 *     --steps N      simulation steps (default 1000)
 *     --plotgap N    call the adaptor every N steps (default 100)
 *     --config PATH  adaptor YAML configuration (default: adaptor defaults)
 *     --F --k --Du --Dv --dt --noise   model parameters (defaults: 0.02 0.048 0.2 0.1 1.0 0.1)
 *     --seed N       noise seed (default 0)
 *     --no-insitu    run without the adaptor (baseline timing)
 *
 * Same model as sims/insitu_sims/gray_scott.py (and the ADIOS2 Gray-Scott tutorial):
 *   du/dt = Du lap(u) - u v^2 + F (1 - u) + noise * r,   dv/dt = Dv lap(v) + u v^2 - (F + k) v
 * with a 7-point Laplacian (divided by 6), explicit Euler, periodic boundaries,
 * U = 1, V = 0 except the centred cube [L/2 - d, L/2 + d)^3, d = min(6, L/4) (U = 0.25,
 * V = 0.33). The noise r in [-1, 1) is a hash of (seed, step, global index), the same
 * function as in gray_scott.py: identical for any decomposition.
 *
 * Decomposition: MPI_Dims_create + MPI_Cart_create (periodic), one ghost layer, halo
 * exchange by MPI_Sendrecv of faces (x, then y, then z, so edges and corners come along).
 * Every plotgap steps, U and V (this rank's block, ghosts excluded) go to insitu_execute_fields.
 */
#include "insitu_adaptor.h"

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int L, steps, plotgap, insitu;
    double F, k, Du, Dv, dt, noise;
    uint64_t seed;
    const char *config;
} Settings;

typedef struct {
    int nx, ny, nz;        /* owned samples */
    int64_t start[3];      /* global index (x, y, z) of the first owned sample */
    int nbr[3][2];         /* neighbour ranks (lower, upper) per axis */
    MPI_Comm cart;
    double *u, *v, *u2, *v2;   /* (nz+2)(ny+2)(nx+2), ghosts included */
} Domain;

#define IDX(d, i, j, k) ((size_t)(k) * ((d)->ny + 2) * ((d)->nx + 2) + (size_t)(j) * ((d)->nx + 2) + (size_t)(i))

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Deterministic noise in [-1, 1) for a global sample before step `step` (0-based), as
 * sims/insitu_sims/gray_scott.py draws it: splitmix64(index + splitmix64(seed * 0x1000003 + step)). */
static double noise_at(uint64_t seed, int step, int64_t gx, int64_t gy, int64_t gz, int L)
{
    uint64_t id = ((uint64_t)gz * (uint64_t)L + (uint64_t)gy) * (uint64_t)L + (uint64_t)gx;
    uint64_t h = splitmix64(id + splitmix64(seed * 0x1000003ull + (uint64_t)step));
    return (double)(h >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

static void split(int n, int parts, int coord, int *count, int64_t *start)
{
    *start = (int64_t)coord * n / parts;
    *count = (int)((int64_t)(coord + 1) * n / parts - *start);
}

static void domain_init(Domain *d, const Settings *s, MPI_Comm world)
{
    int size, dims[3] = {0, 0, 0}, periods[3] = {1, 1, 1}, coords[3], rank;
    MPI_Comm_size(world, &size);
    MPI_Dims_create(size, 3, dims);  /* (px, py, pz): cart axes are x, y, z as in gray_scott.py */
    MPI_Cart_create(world, 3, dims, periods, 0, &d->cart);
    MPI_Comm_rank(d->cart, &rank);
    MPI_Cart_coords(d->cart, rank, 3, coords);
    split(s->L, dims[0], coords[0], &d->nx, &d->start[0]);
    split(s->L, dims[1], coords[1], &d->ny, &d->start[1]);
    split(s->L, dims[2], coords[2], &d->nz, &d->start[2]);
    for (int a = 0; a < 3; a++)
        MPI_Cart_shift(d->cart, a, 1, &d->nbr[a][0], &d->nbr[a][1]);
    size_t n = (size_t)(d->nx + 2) * (d->ny + 2) * (d->nz + 2);
    d->u = malloc(n * sizeof(double));
    d->v = malloc(n * sizeof(double));
    d->u2 = malloc(n * sizeof(double));
    d->v2 = malloc(n * sizeof(double));
    if (!d->u || !d->v || !d->u2 || !d->v2) {
        fprintf(stderr, "gray_scott: out of memory for a %dx%dx%d block\n", d->nx, d->ny, d->nz);
        MPI_Abort(world, 1);
    }
    const int half = s->L / 2, r = s->L / 4 < 6 ? s->L / 4 : 6;   /* cube [L/2 - r, L/2 + r) */
    for (int k = 0; k < d->nz + 2; k++)
        for (int j = 0; j < d->ny + 2; j++)
            for (int i = 0; i < d->nx + 2; i++) {
                int64_t g[3] = {d->start[0] + i - 1, d->start[1] + j - 1, d->start[2] + k - 1};
                int inside = 1;
                for (int a = 0; a < 3; a++)
                    inside &= g[a] >= half - r && g[a] < half + r;
                d->u[IDX(d, i, j, k)] = inside ? 0.25 : 1.0;
                d->v[IDX(d, i, j, k)] = inside ? 0.33 : 0.0;
            }
}

/* Exchange one face layer along axis a (0 x, 1 y, 2 z) of field f, ghosts of the other axes included. */
static void exchange_axis(Domain *d, double *f, int a)
{
    int n[3] = {d->nx + 2, d->ny + 2, d->nz + 2};
    int b = (a + 1) % 3, c = (a + 2) % 3;   /* the two other axes */
    size_t m = (size_t)n[b] * n[c];
    double *buf = calloc(4 * m, sizeof(double));
    if (!buf) {
        fprintf(stderr, "gray_scott: out of memory for the halo buffers\n");
        MPI_Abort(d->cart, 1);
        return;
    }
    double *send_lo = buf, *send_hi = buf + m, *recv_lo = buf + 2 * m, *recv_hi = buf + 3 * m;
    int own[3] = {d->nx, d->ny, d->nz};
    size_t p = 0;
    for (int y = 0; y < n[c]; y++)
        for (int x = 0; x < n[b]; x++, p++) {
            int lo[3], hi[3];
            lo[a] = 1;       hi[a] = own[a];
            lo[b] = hi[b] = x;
            lo[c] = hi[c] = y;
            send_lo[p] = f[IDX(d, lo[0], lo[1], lo[2])];
            send_hi[p] = f[IDX(d, hi[0], hi[1], hi[2])];
        }
    MPI_Sendrecv(send_lo, (int)m, MPI_DOUBLE, d->nbr[a][0], 10 + a, recv_hi, (int)m, MPI_DOUBLE, d->nbr[a][1],
                 10 + a, d->cart, MPI_STATUS_IGNORE);
    MPI_Sendrecv(send_hi, (int)m, MPI_DOUBLE, d->nbr[a][1], 20 + a, recv_lo, (int)m, MPI_DOUBLE, d->nbr[a][0],
                 20 + a, d->cart, MPI_STATUS_IGNORE);
    p = 0;
    for (int y = 0; y < n[c]; y++)
        for (int x = 0; x < n[b]; x++, p++) {
            int lo[3], hi[3];
            lo[a] = 0;       hi[a] = own[a] + 1;
            lo[b] = hi[b] = x;
            lo[c] = hi[c] = y;
            f[IDX(d, lo[0], lo[1], lo[2])] = recv_lo[p];
            f[IDX(d, hi[0], hi[1], hi[2])] = recv_hi[p];
        }
    free(buf);
}

static void exchange(Domain *d, double *f)
{
    for (int a = 0; a < 3; a++)
        exchange_axis(d, f, a);
}

static void advance(Domain *d, const Settings *s, int step)
{
    exchange(d, d->u);
    exchange(d, d->v);
    const size_t sx = 1, sy = (size_t)d->nx + 2, sz = sy * ((size_t)d->ny + 2);
    for (int k = 1; k <= d->nz; k++)
        for (int j = 1; j <= d->ny; j++)
            for (int i = 1; i <= d->nx; i++) {
                size_t c = IDX(d, i, j, k);
                double u = d->u[c], v = d->v[c];
                double lu = (d->u[c - sx] + d->u[c + sx] + d->u[c - sy] + d->u[c + sy] + d->u[c - sz] +
                             d->u[c + sz] - 6.0 * u) / 6.0;
                double lv = (d->v[c - sx] + d->v[c + sx] + d->v[c - sy] + d->v[c + sy] + d->v[c - sz] +
                             d->v[c + sz] - 6.0 * v) / 6.0;
                double r = s->noise == 0.0 ? 0.0
                         : noise_at(s->seed, step - 1, d->start[0] + i - 1, d->start[1] + j - 1, d->start[2] + k - 1, s->L);
                double uvv = u * v * v;
                d->u2[c] = u + s->dt * (s->Du * lu - uvv + s->F * (1.0 - u) + s->noise * r);
                d->v2[c] = v + s->dt * (s->Dv * lv + uvv - (s->F + s->k) * v);
            }
    double *t = d->u; d->u = d->u2; d->u2 = t;
    t = d->v; d->v = d->v2; d->v2 = t;
}

/* The owned samples of f, without ghosts, into out [nz][ny][nx]. */
static void owned(const Domain *d, const double *f, double *out)
{
    size_t p = 0;
    for (int k = 1; k <= d->nz; k++)
        for (int j = 1; j <= d->ny; j++) {
            memcpy(out + p, f + IDX(d, 1, j, k), (size_t)d->nx * sizeof(double));
            p += (size_t)d->nx;
        }
}

static int parse(int argc, char **argv, Settings *s)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(flag, expr) if (!strcmp(a, flag)) { if (!v) return i; expr; i++; continue; }
        OPT("--L", s->L = atoi(v))
        OPT("--steps", s->steps = atoi(v))
        OPT("--plotgap", s->plotgap = atoi(v))
        OPT("--config", s->config = v)
        OPT("--F", s->F = atof(v))
        OPT("--k", s->k = atof(v))
        OPT("--Du", s->Du = atof(v))
        OPT("--Dv", s->Dv = atof(v))
        OPT("--dt", s->dt = atof(v))
        OPT("--noise", s->noise = atof(v))
        OPT("--seed", s->seed = strtoull(v, NULL, 10))
#undef OPT
        if (!strcmp(a, "--no-insitu")) { s->insitu = 0; continue; }
        return i;
    }
    return s->L >= 2 && s->steps >= 0 && s->plotgap >= 1 ? 0 : -1;
}

int main(int argc, char **argv)
{
    int provided, rank;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);  /* background training needs it */
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    Settings s = {64, 1000, 100, 1, 0.02, 0.048, 0.2, 0.1, 1.0, 0.1, 0, NULL};
    int bad = parse(argc, argv, &s);
    if (bad) {
        if (rank == 0)
            fprintf(stderr, "gray_scott: %s %s\nusage: gray_scott_c [--L N] [--steps N] [--plotgap N] "
                    "[--config PATH] [--F F] [--k K] [--Du D] [--Dv D] [--dt DT] [--noise A] [--seed S] "
                    "[--no-insitu]\n", bad > 0 ? "bad or incomplete option" : "invalid settings",
                    bad > 0 ? argv[bad] : "(need L >= 2, steps >= 0, plotgap >= 1)");
        MPI_Finalize();
        return 2;
    }
    Domain d;
    domain_init(&d, &s, MPI_COMM_WORLD);
    int rc = 0;
    if (s.insitu && insitu_initialize(d.cart, s.config) != INSITU_OK) {
        fprintf(stderr, "gray_scott: rank %d: insitu_initialize failed: %s\n", rank, insitu_last_error());
        MPI_Finalize();
        return 3;
    }
    if (s.insitu) {
        double spacing = 1.0 / (s.L - 1), origin[3] = {0, 0, 0}, sp[3] = {spacing, spacing, spacing};
        insitu_set_geometry(origin, sp);
    }
    size_t n = (size_t)d.nx * d.ny * d.nz;
    double *u = malloc(n * sizeof(double)), *v = malloc(n * sizeof(double));
    const int64_t global[3] = {s.L, s.L, s.L}, count[3] = {d.nx, d.ny, d.nz};
    double t0 = MPI_Wtime(), t_insitu = 0.0;
    for (int step = 1; step <= s.steps && rc == 0; step++) {
        advance(&d, &s, step);
        if (s.insitu && (step % s.plotgap == 0 || step == s.steps)) {
            double t = MPI_Wtime();
            owned(&d, d.u, u);
            owned(&d, d.v, v);
            insitu_field fields[2] = {{"U", u, INSITU_FLOAT64}, {"V", v, INSITU_FLOAT64}};
            if (insitu_execute_fields(step, step * s.dt, 2, fields, global, d.start, count) != INSITU_OK) {
                fprintf(stderr, "gray_scott: rank %d: insitu_execute failed at step %d: %s\n", rank, step,
                        insitu_last_error());
                rc = 4;
            }
            t_insitu += MPI_Wtime() - t;
        }
    }
    double elapsed = MPI_Wtime() - t0;
    if (s.insitu && insitu_finalize() != INSITU_OK) {
        fprintf(stderr, "gray_scott: rank %d: insitu_finalize failed: %s\n", rank, insitu_last_error());
        if (!rc)
            rc = 5;
    }
    double sums[2] = {0.0, 0.0}, total[2];
    for (int k = 1; k <= d.nz; k++)
        for (int j = 1; j <= d.ny; j++)
            for (int i = 1; i <= d.nx; i++) {
                sums[0] += d.u[IDX(&d, i, j, k)];
                sums[1] += d.v[IDX(&d, i, j, k)];
            }
    MPI_Reduce(sums, total, 2, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank == 0)
        printf("gray_scott: sum U = %.12e, sum V = %.12e\n", total[0], total[1]);
    if (rank == 0 && rc == 0)
        printf("gray_scott: %d steps of %d^3 in %.3f s (%.3f s in insitu_execute), thread level %d\n", s.steps,
               s.L, elapsed, t_insitu, provided);
    free(u); free(v); free(d.u); free(d.v); free(d.u2); free(d.v2);
    MPI_Comm_free(&d.cart);
    MPI_Finalize();
    return rc;
}
