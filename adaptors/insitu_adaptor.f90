! Fortran interface of the insitu-gs adaptor (over the C API in insitu_adaptor.h).
!
!   use insitu_adaptor
!   call MPI_Init_thread(MPI_THREAD_MULTIPLE, provided, ierr)
!   ierr = insitu_initialize(MPI_COMM_WORLD, "gs.yaml")      ! mpi_f08: MPI_COMM_WORLD%MPI_VAL
!   if (ierr /= INSITU_OK) print *, insitu_last_error()
!   do step = 1, nsteps
!     ...
!     ierr = insitu_execute(step, t, "U", u, global_dims, start)   ! u(nx, ny, nz), no ghosts
!   end do
!   ierr = insitu_finalize()
!
! Arrays are this rank's block, a(x, y, z) (x fastest, as in C's data[z][y][x]); its shape
! is the count. global_dims and start are (x, y, z); start is 0-based, as in the C API.
! Every function is collective and returns INSITU_OK (0) or an error code.
module insitu_adaptor
  use, intrinsic :: iso_c_binding
  implicit none
  private

  integer(c_int), parameter, public :: INSITU_OK = 0, INSITU_ERROR = 1, INSITU_ERROR_STATE = 2, &
                                       INSITU_ERROR_PYTHON = 3
  integer(c_int), parameter, public :: INSITU_UINT8 = 1, INSITU_INT8 = 2, INSITU_UINT16 = 3, &
                                       INSITU_INT16 = 4, INSITU_UINT32 = 5, INSITU_INT32 = 6, &
                                       INSITU_UINT64 = 7, INSITU_INT64 = 8, INSITU_FLOAT32 = 9, &
                                       INSITU_FLOAT64 = 10

  public :: insitu_initialize, insitu_set_geometry, insitu_execute, insitu_finalize, &
            insitu_finalize_discard, insitu_last_error

  interface insitu_execute
    module procedure execute_r4, execute_r8, execute_i4, execute_i1
  end interface

  interface
    function c_initialize_f(comm, config_path) bind(C, name="insitu_initialize_f") result(rc)
      import :: c_int, c_char
      integer(c_int), value :: comm
      character(kind=c_char), dimension(*), intent(in) :: config_path
      integer(c_int) :: rc
    end function
    function c_set_geometry(origin, spacing) bind(C, name="insitu_set_geometry") result(rc)
      import :: c_int, c_double
      real(c_double), dimension(3), intent(in) :: origin, spacing
      integer(c_int) :: rc
    end function
    function c_execute(step, time, name, data, dtype, global_dims, start, count) &
        bind(C, name="insitu_execute") result(rc)
      import :: c_int, c_double, c_char, c_ptr, c_int64_t
      integer(c_int), value :: step
      real(c_double), value :: time
      character(kind=c_char), dimension(*), intent(in) :: name
      type(c_ptr), value :: data
      integer(c_int), value :: dtype
      integer(c_int64_t), dimension(3), intent(in) :: global_dims, start, count
      integer(c_int) :: rc
    end function
    function c_finalize() bind(C, name="insitu_finalize") result(rc)
      import :: c_int
      integer(c_int) :: rc
    end function
    function c_finalize_discard() bind(C, name="insitu_finalize_discard") result(rc)
      import :: c_int
      integer(c_int) :: rc
    end function
    function c_last_error() bind(C, name="insitu_last_error") result(p)
      import :: c_ptr
      type(c_ptr) :: p
    end function
    function c_strlen(s) bind(C, name="strlen") result(n)
      import :: c_ptr, c_size_t
      type(c_ptr), value :: s
      integer(c_size_t) :: n
    end function
  end interface

contains

  !> Start the adaptor on the Fortran communicator handle comm (mpi: an integer; mpi_f08:
  !> comm%MPI_VAL). config_path: a YAML file; absent or blank for the defaults.
  integer function insitu_initialize(comm, config_path) result(rc)
    integer, intent(in) :: comm
    character(len=*), intent(in), optional :: config_path
    if (present(config_path)) then
      rc = c_initialize_f(int(comm, c_int), trim(config_path) // c_null_char)
    else
      rc = c_initialize_f(int(comm, c_int), c_null_char)
    end if
  end function

  !> World position of global sample (0, 0, 0) and size of one cell, (x, y, z).
  integer function insitu_set_geometry(origin, spacing) result(rc)
    real(c_double), dimension(3), intent(in) :: origin, spacing
    rc = c_set_geometry(origin, spacing)
  end function

  integer function execute_r4(step, time, name, a, global_dims, start) result(rc)
    integer, intent(in) :: step
    real(c_double), intent(in) :: time
    character(len=*), intent(in) :: name
    real(c_float), dimension(:, :, :), contiguous, target, intent(in) :: a
    integer(c_int64_t), dimension(3), intent(in) :: global_dims, start
    rc = execute_ptr(step, time, name, c_loc(a), INSITU_FLOAT32, global_dims, start, shape(a))
  end function

  integer function execute_r8(step, time, name, a, global_dims, start) result(rc)
    integer, intent(in) :: step
    real(c_double), intent(in) :: time
    character(len=*), intent(in) :: name
    real(c_double), dimension(:, :, :), contiguous, target, intent(in) :: a
    integer(c_int64_t), dimension(3), intent(in) :: global_dims, start
    rc = execute_ptr(step, time, name, c_loc(a), INSITU_FLOAT64, global_dims, start, shape(a))
  end function

  integer function execute_i4(step, time, name, a, global_dims, start) result(rc)
    integer, intent(in) :: step
    real(c_double), intent(in) :: time
    character(len=*), intent(in) :: name
    integer(c_int32_t), dimension(:, :, :), contiguous, target, intent(in) :: a
    integer(c_int64_t), dimension(3), intent(in) :: global_dims, start
    rc = execute_ptr(step, time, name, c_loc(a), INSITU_INT32, global_dims, start, shape(a))
  end function

  !> Bytes (e.g. segmentation labels); passed as unsigned 8-bit values.
  integer function execute_i1(step, time, name, a, global_dims, start) result(rc)
    integer, intent(in) :: step
    real(c_double), intent(in) :: time
    character(len=*), intent(in) :: name
    integer(c_int8_t), dimension(:, :, :), contiguous, target, intent(in) :: a
    integer(c_int64_t), dimension(3), intent(in) :: global_dims, start
    rc = execute_ptr(step, time, name, c_loc(a), INSITU_UINT8, global_dims, start, shape(a))
  end function

  !> What every typed wrapper does: the C call with a NUL-terminated name and the count.
  integer function execute_ptr(step, time, name, data, dtype, global_dims, start, count) result(rc)
    integer, intent(in) :: step, count(3)
    real(c_double), intent(in) :: time
    character(len=*), intent(in) :: name
    type(c_ptr), intent(in) :: data
    integer(c_int), intent(in) :: dtype
    integer(c_int64_t), dimension(3), intent(in) :: global_dims, start
    rc = c_execute(int(step, c_int), time, trim(name) // c_null_char, data, dtype, global_dims, start, &
                   int(count, c_int64_t))
  end function

  integer function insitu_finalize() result(rc)
    rc = c_finalize()
  end function

  !> Like insitu_finalize, but steps still waiting are dropped instead of trained.
  integer function insitu_finalize_discard() result(rc)
    rc = c_finalize_discard()
  end function

  !> The message of the last error on this rank ('' if none).
  function insitu_last_error() result(msg)
    character(len=:), allocatable :: msg
    type(c_ptr) :: p
    character(kind=c_char), dimension(:), pointer :: chars
    integer :: i, n
    p = c_last_error()
    n = int(c_strlen(p))
    call c_f_pointer(p, chars, [n])
    allocate(character(len=n) :: msg)
    do i = 1, n
      msg(i:i) = chars(i)
    end do
  end function

end module insitu_adaptor
