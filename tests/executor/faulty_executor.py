"""``moelora-executor`` with ``faults.faulting_kernel``, for tests that need an executor
process whose device faults on cue: ``python -m tests.executor.faulty_executor FLAGS...``."""

from executor_service.main import main
from tests.executor.faults import faulting_kernel

if __name__ == "__main__":
    main(kernel=faulting_kernel)
