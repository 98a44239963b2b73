from mpfused.optim.adamw import Adam, AdamW  # noqa: F401
from mpfused.optim.lion import Lion  # noqa: F401
from mpfused.optim.sgd import SGD  # noqa: F401
from mpfused.optim.adamw4bit import Adam4bit, AdamW4bit  # noqa: F401
from mpfused.optim.adamw8bit import Adam8bit, AdamW8bit, keep_32bit_state  # noqa: F401
from mpfused.optim.lion4bit import Lion4bit  # noqa: F401
from mpfused.optim.lion8bit import Lion8bit  # noqa: F401
from mpfused.optim.sgd4bit import SGD4bit  # noqa: F401
from mpfused.optim.sgd8bit import SGD8bit  # noqa: F401
from mpfused.optim.release import GradRelease, step_in_backward  # noqa: F401
