! A moving sphere, from Fortran: the smallest simulation that links the insitu-gs adaptor's
! Fortran module (InsituGS::adaptor_fortran).
!
!   mpiexec -n 2 sphere_f --config sphere.yaml [--steps N] [--real4]
!
! The grid is NX x NY x NZ cells (x fastest), cut into slabs along z, one per rank. Field "D"
! is the signed distance to a sphere of radius R whose centre moves along x by one cell per
! step; its isosurface D = 0 is the sphere. Each step this rank's slab, a(x, y, z), goes to
! insitu_execute (real(c_double), or real(c_float) with --real4).
!
! MPI is started through mpi_world.c (C), so the program needs only the C MPI library; a
! code with `use mpi` passes its MPI_COMM_WORLD (mpi_f08: MPI_COMM_WORLD%MPI_VAL) instead.
program sphere
  use, intrinsic :: iso_c_binding
  use, intrinsic :: iso_fortran_env, only: error_unit
  use insitu_adaptor
  implicit none

  interface
    integer(c_int) function world_init(rank, nranks) bind(C, name="world_init")
      import :: c_int
      integer(c_int), intent(out) :: rank, nranks
    end function
    subroutine world_finalize() bind(C, name="world_finalize")
    end subroutine
  end interface

  integer, parameter :: NX = 40, NY = 28, NZ = 20
  real(c_double), parameter :: R = 6.0d0, CY = 11.0d0, CZ = 8.0d0
  integer(c_int64_t) :: global(3), start(3)
  real(c_double), allocatable :: a8(:, :, :)
  real(c_float), allocatable :: a4(:, :, :)
  character(len=512) :: arg, config
  integer(c_int) :: rank, nranks
  integer :: comm, steps, step, i, j, k, z0, nzl, rc, ios
  logical :: real4
  real(c_double) :: cx

  comm = world_init(rank, nranks)
  config = ''
  steps = 2
  real4 = .false.
  i = 1
  do while (i <= command_argument_count())
    call get_command_argument(i, arg)
    select case (trim(arg))
    case ('--config')
      i = i + 1
      call get_command_argument(i, config, status=ios)
      if (ios /= 0) call usage('--config needs a file name')
    case ('--steps')
      i = i + 1
      call get_command_argument(i, arg, status=ios)
      if (ios == 0) read (arg, *, iostat=ios) steps
      if (ios /= 0 .or. steps < 0) call usage('--steps needs an integer >= 0')
    case ('--real4')
      real4 = .true.
    case default
      call usage('unknown argument ' // trim(arg))
    end select
    i = i + 1
  end do
  if (nranks > NZ) call usage('at most 20 ranks (one z-slab of the 40 x 28 x 20 grid each)')

  ! this rank's slab along z: cells z0 .. z0 + nzl - 1 (0-based)
  z0 = rank * NZ / nranks
  nzl = (rank + 1) * NZ / nranks - z0
  global = [integer(c_int64_t) :: NX, NY, NZ]
  start = [integer(c_int64_t) :: 0, 0, z0]
  allocate (a8(NX, NY, nzl), a4(NX, NY, nzl))

  rc = insitu_initialize(comm, trim(config))
  if (rc /= INSITU_OK) then
    write (error_unit, '(a, i0, 2a)') 'sphere_f: rank ', rank, ': insitu_initialize failed: ', insitu_last_error()
    call world_finalize()
    stop 1
  end if

  do step = 1, steps
    cx = 12.0d0 + step
    do k = 1, nzl
      do j = 1, NY
        do i = 1, NX
          a8(i, j, k) = sqrt((i - 1 - cx)**2 + (j - 1 - CY)**2 + (z0 + k - 1 - CZ)**2) - R
        end do
      end do
    end do
    if (real4) then
      a4 = real(a8, c_float)
      rc = insitu_execute(step, real(step, c_double), 'D', a4, global, start)
    else
      rc = insitu_execute(step, real(step, c_double), 'D', a8, global, start)
    end if
    if (rc /= INSITU_OK) then
      write (error_unit, '(a, i0, a, i0, 2a)') 'sphere_f: rank ', rank, ': insitu_execute failed at step ', &
                                                step, ': ', insitu_last_error()
      exit
    end if
  end do

  if (insitu_finalize() /= INSITU_OK) then
    write (error_unit, '(a, i0, 2a)') 'sphere_f: rank ', rank, ': insitu_finalize failed: ', insitu_last_error()
    rc = INSITU_ERROR
  end if
  if (rank == 0 .and. rc == INSITU_OK) then
    if (real4) then
      write (*, '(a, i0, a)') 'sphere_f: ', steps, ' steps done (real(c_float) fields)'
    else
      write (*, '(a, i0, a)') 'sphere_f: ', steps, ' steps done (real(c_double) fields)'
    end if
  end if
  call world_finalize()
  if (rc /= INSITU_OK) stop 1

contains

  !> Bad command line: say why (rank 0), end MPI on every rank, exit 2.
  subroutine usage(why)
    character(len=*), intent(in) :: why
    if (rank == 0) write (error_unit, '(3a)') 'sphere_f: ', why, &
                                              '; usage: sphere_f [--config FILE] [--steps N] [--real4]'
    call world_finalize()
    stop 2
  end subroutine

end program sphere
