//! A pool for the many short parallel loops of a decode step.
//!
//! A batch-1 decode step runs ~120 matmuls of 30–300 µs, each between a few
//! hundred µs of single-threaded torch work. Rayon's workers go to sleep in
//! between, and waking them costs ~50 µs a call (measured: the same 60 Q4_1
//! matmuls took 66 µs each back to back and 120 µs each with 200 µs of other
//! work between calls). Here the caller takes part in its own loop and the
//! helpers spin for a while after their last task before they sleep, so a
//! call that follows within [`SPIN`] (or `GUIDED_KERNEL_SPIN_US`) starts on every thread at once. Rayon has
//! no setting for this; everything else in guided keeps using rayon.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle helper spins before it sleeps, unless the environment's
/// `GUIDED_KERNEL_SPIN_US` says otherwise (0: sleep at once, for a machine
/// shared with other work, at the cost of a wake-up per call).
const SPIN: Duration = Duration::from_millis(2);

fn spin() -> Duration {
    static SET: OnceLock<Duration> = OnceLock::new();
    *SET.get_or_init(|| {
        std::env::var("GUIDED_KERNEL_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(SPIN, Duration::from_micros)
    })
}

struct Job {
    /// The loop body; only called for claimed indices below `tasks`, all of
    /// which finish before [`run`] returns (so the borrow it erases outlives every call).
    body: &'static (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
    /// Whether the helpers spin after this job, for a next call soon (see [`run_then_sleep`]).
    linger: bool,
}

impl Job {
    /// Claim and run tasks until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.tasks {
                return;
            }
            if catch_unwind(AssertUnwindSafe(|| (self.body)(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

struct Shared {
    epoch: AtomicUsize,
    job: Mutex<Option<Arc<Job>>>,
    wake: Condvar,
}

struct Pool {
    shared: Arc<Shared>,
    threads: usize,
    /// One loop at a time: callers from several threads take turns.
    turn: Mutex<()>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = rayon::current_num_threads().max(1);
        let shared = Arc::new(Shared { epoch: AtomicUsize::new(0), job: Mutex::new(None), wake: Condvar::new() });
        for n in 1..threads {
            let shared = shared.clone();
            std::thread::Builder::new().name(format!("guided-kernel-{n}")).spawn(move || helper(&shared)).expect("spawn");
        }
        Pool { shared, threads, turn: Mutex::new(()) }
    })
}

fn helper(shared: &Shared) {
    let mut seen = 0;
    let spin = spin();
    let mut linger = true;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while shared.epoch.load(Ordering::Acquire) == seen {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if !linger || (spins % 256 == 0 && start.elapsed() >= spin) {
                let guard = shared.job.lock().unwrap();
                let _guard = shared.wake.wait_while(guard, |_| shared.epoch.load(Ordering::Acquire) == seen).unwrap();
                break;
            }
        }
        seen = shared.epoch.load(Ordering::Acquire);
        let job = shared.job.lock().unwrap().clone();
        if let Some(job) = job {
            linger = job.linger;
            job.work();
        }
    }
}

/// A pointer a parallel loop's tasks write through, each to its own part
/// (the caller answers for that); `get()` is a method so closures capture
/// the wrapper, which is Sync, not its raw field.
pub struct SendPtr<T>(pub *mut T);

impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY: see the type's comment: tasks write disjoint parts, and the memory outlives the loop
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    pub fn get(self) -> *mut T {
        self.0
    }
}

/// The number of threads a loop runs on (the caller's included).
pub fn threads() -> usize {
    pool().threads
}

/// Run `body(i)` for every i in 0..tasks, on the caller and the helpers; returns when all are done.
pub fn run(tasks: usize, body: &(dyn Fn(usize) + Sync)) {
    run_job(tasks, body, true)
}

/// [`run`] over the items of a slice, each task with its own item alone.
pub fn for_each_mut<T: Send>(items: &mut [T], body: &(dyn Fn(&mut T) + Sync)) {
    let at = SendPtr(items.as_mut_ptr());
    // SAFETY: task i alone touches items[i], borrowed until the loop is done
    run(items.len(), &|i| body(unsafe { &mut *at.get().add(i) }));
}

/// As [`run`], but the helpers sleep as soon as the loop is done: for calls
/// between which other threads need the cores (torch's own, in a step whose
/// matmuls are torch's), where spinning helpers slowed a float32 step by a third.
pub fn run_then_sleep(tasks: usize, body: &(dyn Fn(usize) + Sync)) {
    run_job(tasks, body, false)
}

fn run_job(tasks: usize, body: &(dyn Fn(usize) + Sync), linger: bool) {
    let pool = pool();
    if tasks <= 1 || pool.threads == 1 {
        (0..tasks).for_each(body);
        return;
    }
    let _turn = pool.turn.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: `body` is only called through the job until `done == tasks`, which is awaited below.
    let body: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(body) };
    let job = Arc::new(Job {
        body,
        tasks,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
        linger,
    });
    {
        let mut slot = pool.shared.job.lock().unwrap();
        *slot = Some(job.clone());
        pool.shared.epoch.fetch_add(1, Ordering::Release);
    }
    pool.shared.wake.notify_all();
    job.work();
    while job.done.load(Ordering::Acquire) < tasks {
        std::hint::spin_loop();
    }
    *pool.shared.job.lock().unwrap() = None;
    if job.panicked.load(Ordering::Relaxed) {
        panic!("a task of a parallel kernel loop panicked");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_many_calls() {
        for tasks in [0, 1, 2, 7, 64] {
            for _ in 0..200 {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn callers_on_several_threads_take_turns() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..100 {
                        run(8, &|_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 100 * 8);
    }
}
