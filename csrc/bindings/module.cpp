// The extension module mpfused._C: importing it runs the static TORCH_LIBRARY_IMPL registrars.
// No pybind11, so the module can be built against the limited API (one abi3 wheel per platform).
#include <Python.h>

#ifndef MPFUSED_WITH_CUDA
#define MPFUSED_WITH_CUDA 0
#endif
#ifndef MPFUSED_CUDA_ARCHS
#define MPFUSED_CUDA_ARCHS ""
#endif

int mpfused_add_ready_hook(PyObject* module);  // release_hook.cpp

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "mpfused native kernels", -1,
                                   nullptr};
  PyObject* m = PyModule_Create(&def);
  if (!m) return nullptr;
  PyModule_AddIntConstant(m, "with_cuda", MPFUSED_WITH_CUDA);
  PyModule_AddStringConstant(m, "cuda_archs", MPFUSED_CUDA_ARCHS);
  if (mpfused_add_ready_hook(m) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
}
