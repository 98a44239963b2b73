// mpfused._C.ReadyHook: gradient release's post-accumulate-grad hook of one param
// (mpfused/optim/release.py, GradRelease._grad_ready_hook), as a C object. It does what the
// Python hook does, step for step: nothing while accumulating; the backward's start (the
// handle's _first_grad) at the first grad of a backward; the param marked ready; at the bucket's
// last param the armed release (ArmedStep::run, armed_step.h) where GradRelease._release would
// run it in place, else GradRelease._release itself. Why: on CPU the Python hooks, the release's
// Python and the armed call's TorchScript-class call cost ~1 ms a backward on the main job's
// small model (2-core VM, perf samples: benchmarks/results/release-native-hook-*.txt), run cold
// between the backward's ops, as long as the bucket updates themselves. Limited API only.
#include <Python.h>

#include <c10/core/GradMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <exception>
#include <string>

#include "armed_step.h"

namespace {

struct ReadyHook {
  PyObject_HEAD
  PyObject* handle;  // the GradRelease
  PyObject* chunk;   // its _Chunk (release bucket)
  PyObject* ready;   // chunk.ready: the set of the bucket's params ready in this backward
  PyObject* index;   // this param's index in its group (an int)
  PyObject* epoch;   // mpfused.optim._state_table._EPOCH (a one-element list)
  Py_ssize_t size;   // len(chunk.indices)
};

PyObject *s_accumulating, *s_in_backward, *s_end, *s_first_grad, *s_release, *s_worker_in_use,
    *s_call, *s_order, *s_optimizer, *s_state;

// 1 / 0: the attribute's truth; -1: an error is set.
int attr_truth(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (!v) return -1;
  const int r = PyObject_IsTrue(v);
  Py_DECREF(v);
  return r;
}

// GradRelease._backward_open: self._in_backward and (self._end is None or self._end() is not None)
// (its logic again, not a call: a subclass's own _backward_open is not seen here;
// tests/test_release_native_hook.py holds the two hooks to the same results).
int backward_open(PyObject* h) {
  const int in_backward = attr_truth(h, s_in_backward);
  if (in_backward <= 0) return in_backward;
  PyObject* end = PyObject_GetAttr(h, s_end);
  if (!end) return -1;
  if (end == Py_None) {
    Py_DECREF(end);
    return 1;
  }
  PyObject* alive = PyObject_CallObject(end, nullptr);  // (a weakref: its referent or None)
  Py_DECREF(end);
  if (!alive) return -1;
  const int open = alive != Py_None;
  Py_DECREF(alive);
  return open;
}

// The Python exception torch would raise for a C++ one (torch's translation of c10 errors, as
// in a TorchScript-class call: the Python hook's path); sets it.
void set_python_error(std::exception_ptr thrown) {
  const bool trace = std::getenv("TORCH_SHOW_CPP_STACKTRACES") &&
                     std::string(std::getenv("TORCH_SHOW_CPP_STACKTRACES")) == "1";
  PyObject* type = PyExc_RuntimeError;
  std::string message;
  try {
    std::rethrow_exception(thrown);
  } catch (const c10::Error& e) {
    message = trace ? e.what() : e.what_without_backtrace();
    if (dynamic_cast<const c10::IndexError*>(&e)) type = PyExc_IndexError;
    else if (dynamic_cast<const c10::ValueError*>(&e)) type = PyExc_ValueError;
    else if (dynamic_cast<const c10::TypeError*>(&e)) type = PyExc_TypeError;
    else if (dynamic_cast<const c10::NotImplementedError*>(&e)) type = PyExc_NotImplementedError;
    else if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) {
      PyObject* torch = PyImport_ImportModule("torch");  // torch.OutOfMemoryError (a RuntimeError)
      PyObject* oom = torch ? PyObject_GetAttrString(torch, "OutOfMemoryError") : nullptr;
      Py_XDECREF(torch);
      PyErr_Clear();
      if (oom) {
        PyErr_SetString(oom, message.c_str());
        Py_DECREF(oom);
        return;
      }
    }
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "mpfused: a gradient release failed with an unknown C++ exception";
  }
  PyErr_SetString(type, message.c_str());
}

// The armed release of a complete bucket, as GradRelease._release's first branch: in place, or
// queued on the release worker where the backward has one (_worker_in_use: its (threads,
// worker, address), set with _submit). 1 done (the bucket stepped or queued, its grads None, its
// ready set empty); 0 not taken (the set as it was: the caller takes GradRelease._release); -1
// an error is set. Under a Python dispatch mode it is not taken: the update may call into
// Python, whose errors the Python path raises as they are.
int run_armed(ReadyHook* self) {
  if (c10::GradMode::is_enabled() || c10::impl::TorchDispatchModeTLS::any_modes_set()) return 0;
  PyObject* worker = PyObject_GetAttr(self->handle, s_worker_in_use);  // None: in place
  if (!worker) return -1;
  void* to_worker = nullptr;
  if (worker != Py_None) {
    PyObject* address = PyTuple_Check(worker) && PyTuple_Size(worker) == 3
                            ? PyTuple_GetItem(worker, 2) : nullptr;
    to_worker = address ? PyLong_AsVoidPtr(address) : nullptr;
    if (!to_worker) {
      Py_DECREF(worker);
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "ReadyHook: _worker_in_use is not (threads, worker, address)");
      return -1;
    }
  }
  PyObject* call = PyObject_GetAttr(self->chunk, s_call);  // (epoch, state, ArmedStep, address)
  if (!call) {
    Py_DECREF(worker);
    return -1;
  }
  int usable = call != Py_None && PyTuple_Check(call) && PyTuple_Size(call) == 4;
  if (usable) {
    PyObject* now = PyList_GetItem(self->epoch, 0);
    usable = now ? PyObject_RichCompareBool(PyTuple_GetItem(call, 0), now, Py_EQ) : -1;
  }
  if (usable == 1) {
    PyObject* opt = PyObject_GetAttr(self->handle, s_optimizer);
    PyObject* state = opt ? PyObject_GetAttr(opt, s_state) : nullptr;
    usable = state ? state == PyTuple_GetItem(call, 1) : -1;
    Py_XDECREF(state);
    Py_XDECREF(opt);
  }
  const mpfused::bind::ArmedStep* armed = nullptr;
  if (usable == 1) {
    armed = static_cast<const mpfused::bind::ArmedStep*>(PyLong_AsVoidPtr(PyTuple_GetItem(call, 3)));
    usable = armed ? PySet_Clear(self->ready) == 0 ? 1 : -1 : PyErr_Occurred() ? -1 : 0;
  }
  if (usable != 1) {
    Py_DECREF(call);
    Py_DECREF(worker);
    return usable;
  }
  // `call` holds the step (call[2], its TorchScript object) and `worker` the worker while they
  // run without the GIL (another thread may drop the handle's references meanwhile).
  bool done = false;
  std::exception_ptr thrown;
  PyThreadState* thread = PyEval_SaveThread();  // (the kernels need no GIL)
  try {
    done = to_worker ? mpfused::bind::submit_to_worker(to_worker, armed) : armed->run();
  } catch (...) {
    thrown = std::current_exception();
  }
  PyEval_RestoreThread(thread);
  Py_DECREF(call);
  Py_DECREF(worker);
  if (thrown) {
    if (!PyErr_Occurred()) set_python_error(thrown);  // (one a Python kernel set stays)
    return -1;
  }
  if (done) return 1;
  // a param without a grad (a later hook set it to None): the bucket ready again, for _release
  PyObject* order = PyObject_GetAttr(self->chunk, s_order);
  if (!order) return -1;
  const Py_ssize_t n = PyTuple_Check(order) ? PyTuple_Size(order) : 0;
  for (Py_ssize_t k = 0; k < n; ++k)
    if (PySet_Add(self->ready, PyTuple_GetItem(order, k)) < 0) {
      Py_DECREF(order);
      return -1;
    }
  Py_DECREF(order);
  return 0;
}

PyObject* hook_call(PyObject* obj, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<ReadyHook*>(obj);
  if (!self->handle || !self->chunk || !self->ready || !self->index || !self->epoch) {
    PyErr_SetString(PyExc_RuntimeError, "ReadyHook: called after it was cleared");
    return nullptr;
  }
  if (!PyTuple_Check(args) || PyTuple_Size(args) != 1 || (kwargs && PyDict_Size(kwargs))) {
    PyErr_SetString(PyExc_TypeError, "ReadyHook takes the param only");
    return nullptr;
  }
  const int accumulating = attr_truth(self->handle, s_accumulating);
  if (accumulating < 0) return nullptr;
  if (accumulating) Py_RETURN_NONE;
  const int open = backward_open(self->handle);
  if (open < 0) return nullptr;
  if (!open) {
    PyObject* r = PyObject_CallMethodObjArgs(self->handle, s_first_grad, PyTuple_GetItem(args, 0),
                                             nullptr);
    if (!r) return nullptr;
    Py_DECREF(r);
  }
  if (PySet_Add(self->ready, self->index) < 0) return nullptr;
  const Py_ssize_t n = PySet_Size(self->ready);
  if (n < 0) return nullptr;
  if (n != self->size) Py_RETURN_NONE;
  const int done = run_armed(self);
  if (done < 0) return nullptr;
  if (done) Py_RETURN_NONE;
  return PyObject_CallMethodObjArgs(self->handle, s_release, self->chunk, nullptr);
}

PyObject* hook_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *handle, *chunk, *ready, *index, *epoch;
  Py_ssize_t size;
  static const char* names[] = {"handle", "chunk", "ready", "index", "epoch", "size", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOn", const_cast<char**>(names), &handle,
                                   &chunk, &ready, &index, &epoch, &size))
    return nullptr;
  if (!PySet_Check(ready) || !PyList_Check(epoch) || PyList_Size(epoch) != 1) {
    PyErr_SetString(PyExc_TypeError, "ReadyHook: ready must be a set, epoch a 1-element list");
    return nullptr;
  }
  auto alloc = reinterpret_cast<allocfunc>(PyType_GetSlot(type, Py_tp_alloc));
  auto* self = reinterpret_cast<ReadyHook*>(alloc(type, 0));
  if (!self) return nullptr;
  PyObject** fields[] = {&self->handle, &self->chunk, &self->ready, &self->index, &self->epoch};
  PyObject* values[] = {handle, chunk, ready, index, epoch};
  for (int k = 0; k < 5; ++k) {
    Py_INCREF(values[k]);
    *fields[k] = values[k];
  }
  self->size = size;
  return reinterpret_cast<PyObject*>(self);
}

int hook_traverse(PyObject* obj, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<ReadyHook*>(obj);
  Py_VISIT(self->handle);
  Py_VISIT(self->chunk);
  Py_VISIT(self->ready);
  Py_VISIT(self->index);
  Py_VISIT(self->epoch);
  Py_VISIT(Py_TYPE(obj));  // (a heap type)
  return 0;
}

int hook_clear(PyObject* obj) {
  auto* self = reinterpret_cast<ReadyHook*>(obj);
  Py_CLEAR(self->handle);
  Py_CLEAR(self->chunk);
  Py_CLEAR(self->ready);
  Py_CLEAR(self->index);
  Py_CLEAR(self->epoch);
  return 0;
}

void hook_dealloc(PyObject* obj) {
  PyTypeObject* type = Py_TYPE(obj);
  PyObject_GC_UnTrack(obj);
  hook_clear(obj);
  reinterpret_cast<freefunc>(PyType_GetSlot(type, Py_tp_free))(obj);
  Py_DECREF(type);
}

PyType_Slot hook_slots[] = {
    {Py_tp_call, reinterpret_cast<void*>(hook_call)},
    {Py_tp_new, reinterpret_cast<void*>(hook_new)},
    {Py_tp_traverse, reinterpret_cast<void*>(hook_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(hook_clear)},
    {Py_tp_dealloc, reinterpret_cast<void*>(hook_dealloc)},
    {Py_tp_doc, const_cast<char*>(
                    "ReadyHook(handle, chunk, ready, index, epoch, size): gradient release's "
                    "post-accumulate-grad hook of one param (mpfused/optim/release.py)")},
    {0, nullptr}};

PyType_Spec hook_spec = {"mpfused._C.ReadyHook", sizeof(ReadyHook), 0,
                         Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, hook_slots};

}  // namespace

// Adds ReadyHook to the module (module.cpp); 0, or -1 with an error set.
int mpfused_add_ready_hook(PyObject* module) {
  struct Name {
    PyObject** slot;
    const char* text;
  };
  const Name names[] = {{&s_accumulating, "_accumulating"}, {&s_in_backward, "_in_backward"},
                        {&s_end, "_end"},       {&s_first_grad, "_first_grad"},
                        {&s_release, "_release"}, {&s_worker_in_use, "_worker_in_use"},
                        {&s_call, "call"},      {&s_order, "order"},
                        {&s_optimizer, "optimizer"}, {&s_state, "state"}};
  for (const Name& n : names)
    if (!*n.slot && !(*n.slot = PyUnicode_InternFromString(n.text))) return -1;
  PyObject* type = PyType_FromSpec(&hook_spec);
  if (!type) return -1;
  if (PyModule_AddObject(module, "ReadyHook", type) < 0) {
    Py_DECREF(type);
    return -1;
  }
  return 0;
}
