// ReleaseWorker (torch.classes.mpfused.ReleaseWorker): gradient release's armed bucket updates
// (ArmedStep, armed_step.h) run on a thread of their own while the backward goes on. Why: on a
// CPU the backward's autograd ops run on the calling thread, and a release bucket's update, made
// between two of them, waits on memory (the bucket's states are cold there, ~5x its hot time;
// benchmarks/results/release-armed-calls-*.txt). A CPU backward of small ops leaves cores idle
// and its matmuls wait on compute, not on memory: the update fits beside it.
//
// What stays on the backward's thread (submit): the grads taken from the params, the params'
// version counters bumped (an autograd op that saved a param and runs after its release fails
// as it would with the update made in place there), the grads set to None and the job queued.
// The worker only checks and steps: no Python, no autograd metadata. The backward's end waits
// for the queue (wait); at most `max_pending` jobs wait, so the grads alive stay bounded. Where
// it would wait (a full queue, the backward's end) the backward's thread runs queued jobs itself
// (help_until), one job at a time on either thread: a worker that gets no CPU (a machine busy
// with other work) holds nothing up but the job it runs. An error in a job is raised by the next wait; the jobs
// queued after it are dropped (their grads were freed), as a failed release ends the backward.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>

#include <omp.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "armed_step.h"

namespace mpfused::bind {
namespace {

struct ReleaseWorker : torch::CustomClassHolder {
  // The worker never drops a reference to a tensor or an object Python may also hold: the last
  // reference to a tensor whose Python object was preserved by C++ (or to state holding a
  // PyObject) frees it under the GIL, which the backward's thread holds while it waits here.
  // Finished jobs go back to the backward's thread (`finished`) and are freed there: at its
  // next submit or wait, or as they come while it waits in one (help_until).
  // For the same reason the worker runs under a state made of C++ parts only: grad mode off
  // (as the backward's), and the profiler's debug info and RecordFunction callbacks (a profiler
  // records the worker's ops), not the whole at::ThreadLocalState (Python mode stacks).
  struct Job {
    c10::intrusive_ptr<ArmedStep> armed;
    std::vector<at::Tensor> grads;
    c10::intrusive_ptr<ReleaseFlags> flags;  // the backward's flags as they were at the submit
    std::shared_ptr<c10::ThreadLocalDebugInfo> debug_info;
    at::RecordFunctionTLS record_functions;
  };

  const int threads;
  const size_t max_pending;
  // The lock and the conditions, replaced (the old ones leaked) in a forked child: a condition
  // the parent's thread waited on at the fork is not usable in the child (a signal blocks).
  struct Sync {
    std::mutex mutex;
    std::condition_variable work, done;
  };
  std::unique_ptr<Sync> sync = std::make_unique<Sync>();
  std::deque<Job> queue;
  std::vector<Job> finished;  // run (or dropped), to be freed on the backward's thread
  bool busy = false, stop = false, paused = false;
  int64_t done_count = 0;    // releases run to the end (tests: the worker served them)
  int64_t stolen_count = 0;  // of them, run on the backward's thread (help_until)
  std::exception_ptr error;
  std::unique_ptr<std::thread> thread;  // started by the first submit
  pid_t owner = 0;                      // the process that started it (0: none yet)

  ReleaseWorker(int64_t threads, int64_t max_pending)
      : threads(int(threads)), max_pending(size_t(max_pending)) {
    TORCH_CHECK(threads >= 1, "mpfused: ReleaseWorker threads must be >= 1, got ", threads);
    TORCH_CHECK(max_pending >= 1, "mpfused: ReleaseWorker max_pending must be >= 1, got ",
                max_pending);
  }

  ~ReleaseWorker() override {
    if (forked()) {  // the thread and the lock are the parent's: nothing to join, leaked
      (void)thread.release(), (void)sync.release();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(sync->mutex);
      stop = true, paused = false;
    }
    sync->work.notify_all();
    if (thread) thread->join();
  }

  bool forked() const { return owner != 0 && owner != getpid(); }

  // In a child forked after the thread started, the thread, its lock and its jobs are the
  // parent's (a fork-based DataLoader worker, say): the child starts afresh, and its own thread
  // at its first submit. (No lock: in the child the thread does not exist.)
  void after_fork() {
    if (!forked()) return;
    (void)thread.release(), (void)sync.release();
    sync = std::make_unique<Sync>();
    queue.clear(), finished.clear();
    busy = false, owner = 0;
  }

  // Queues the armed release; false (nothing done) where it must run on this thread instead: a
  // param without a grad (ArmedStep.run's rule), or a Python dispatch mode active (the step would
  // call into Python from the worker, which holds no GIL).
  bool submit(const c10::intrusive_ptr<ArmedStep>& armed) {
    if (c10::impl::TorchDispatchModeTLS::any_modes_set() || c10::GradMode::is_enabled())
      return false;  // (grad mode on: backward(create_graph=True), which the caller refuses too)
    after_fork();
    free_finished();
    std::vector<at::Tensor> grads;
    if (!armed->take_grads(grads)) return false;
    Job job{armed, std::move(grads), c10::make_intrusive<ReleaseFlags>(),
            c10::ThreadLocalDebugInfo::current(), at::get_record_function_tls_()};
    const ReleaseFlags& f = *armed->flags;
    job.flags->set(f.found, f.inv_scale, f.found_total, f.skipped);
    for (const at::Tensor& p : armed->params)
      if (!p.is_inference()) p.unsafeGetTensorImpl()->bump_version();
    armed->free_grads();
    {
      std::unique_lock<std::mutex> lock(sync->mutex);
      if (!thread) {
        owner = getpid();
        thread = std::make_unique<std::thread>([this] { loop(); });
      }
      // a full queue: run its oldest job here rather than wait for a worker that may not get a
      // CPU (a machine busy with other work)
      help_until(lock, [this] { return queue.size() < max_pending; });
      queue.push_back(std::move(job));
    }
    sync->work.notify_one();
    return true;
  }

  // Blocks until every queued release is done and frees them; raises the first error since
  // the last wait.
  void wait() {
    after_fork();
    std::exception_ptr e;
    {
      std::unique_lock<std::mutex> lock(sync->mutex);
      help_until(lock, [this] { return queue.empty() && !busy; });
      std::swap(e, error);
    }
    free_finished();
    if (e) std::rethrow_exception(e);
  }

  void free_finished() {
    std::vector<Job> jobs;
    {
      std::lock_guard<std::mutex> lock(sync->mutex);
      jobs.swap(finished);
    }
  }  // (freed here, outside the lock)

  int64_t completed() {
    after_fork();
    std::lock_guard<std::mutex> lock(sync->mutex);
    return done_count;
  }

  // Tests: a paused worker takes no job (the backward's thread then runs them all), as one that
  // never gets a CPU.
  void pause(bool on) {
    after_fork();
    {
      std::lock_guard<std::mutex> lock(sync->mutex);
      paused = on;
    }
    sync->work.notify_one();
  }

  int64_t stolen() {  // jobs the backward's thread ran itself (help_until)
    after_fork();
    std::lock_guard<std::mutex> lock(sync->mutex);
    return stolen_count;
  }

  // On the backward's thread, under `lock`: until `ready()`, run the oldest queued job here
  // whenever no job is running, else wait. One job runs at a time, on either thread (`busy`):
  // the jobs share the backward's flags and the bucket-found scratch tensor.
  // Finished jobs are freed here as they come (this is the backward's thread): left for the
  // next submit, two finished jobs beside a full queue would hold five buckets' grads.
  template <class Ready>
  void help_until(std::unique_lock<std::mutex>& lock, Ready ready) {
    while (!ready()) {
      if (!finished.empty()) {
        std::vector<Job> jobs;
        jobs.swap(finished);
        lock.unlock();
        jobs.clear();
        lock.lock();
      } else if (!queue.empty() && !busy) {
        std::optional<Job> job;
        const bool failed = take(job);
        ++stolen_count;
        lock.unlock();
        run(job, failed);
        lock.lock();
      } else {
        sync->done.wait(lock);
      }
    }
  }

  // Under the lock: the oldest queued job, marked running; whether an earlier one failed.
  bool take(std::optional<Job>& job) {
    job.emplace(std::move(queue.front()));
    queue.pop_front();
    busy = true;
    return bool(error);
  }

  // Outside the lock: the job run (not if an earlier one failed), then handed to `finished`.
  void run(std::optional<Job>& job, bool failed) {
    std::exception_ptr e;
    if (!failed) {
      c10::AutoGradMode no_grad(false);
      const at::RecordFunctionTLS outer = at::get_record_function_tls_();
      try {
        c10::DebugInfoGuard debug(job->debug_info);
        at::set_record_function_tls_(job->record_functions);
        job->armed->check_and_step(job->grads, *job->flags);
      } catch (...) {
        e = std::current_exception();
      }
      at::set_record_function_tls_(outer);
    }
    {
      std::lock_guard<std::mutex> lock(sync->mutex);
      finished.push_back(std::move(*job));
      if (e && !error) error = e;
      if (!failed && !e) ++done_count;
      busy = false;
    }
    sync->done.notify_all();  // a place in the queue is free, no job runs
    sync->work.notify_one();
  }

  void loop() {
    // the step kernels fork at::get_num_threads() threads: this thread's OpenMP team is its own
    // (torch's lazy per-thread initialisation first, or it would undo the setting)
    at::get_num_threads();
    omp_set_num_threads(threads);
    for (;;) {
      std::optional<Job> job;
      bool failed;
      {
        std::unique_lock<std::mutex> lock(sync->mutex);
        sync->work.wait(lock, [this] { return !busy && !paused && (stop || !queue.empty()); });
        if (queue.empty()) return;  // (stop)
        failed = take(job);
      }
      sync->done.notify_all();  // a place in the queue is free
      run(job, failed);
    }
  }
};

}  // namespace

// ReleaseWorker::submit for the native release hook (release_hook.cpp), which has the worker's
// and the step's addresses (their TorchScript objects held by the caller meanwhile).
bool submit_to_worker(void* worker, const ArmedStep* armed) {
  return static_cast<ReleaseWorker*>(worker)->submit(
      c10::intrusive_ptr<ArmedStep>::reclaim_copy(const_cast<ArmedStep*>(armed)));
}

TORCH_LIBRARY_FRAGMENT(mpfused, m) {
  m.class_<ReleaseWorker>("ReleaseWorker")
      .def(torch::init<int64_t, int64_t>())
      .def("address",
           [](const c10::intrusive_ptr<ReleaseWorker>& self) {
             return reinterpret_cast<int64_t>(self.get());
           })
      .def("submit", &ReleaseWorker::submit)
      .def("wait", &ReleaseWorker::wait)
      .def("completed", &ReleaseWorker::completed)
      .def("stolen", &ReleaseWorker::stolen)
      .def("pause", &ReleaseWorker::pause);
}

}  // namespace mpfused::bind
