//! One rank's membership of a data-parallel job, through the kernel library's c10d layer
//! (`kernels/dist.cpp`): NCCL between GPUs, Gloo between CPU processes, and DDP's reducer,
//! which averages the gradients over the ranks in buckets overlapped with the backward.

use super::ffi::{new_object, pointers, status};
use super::Kernels;
use anyhow::Result;
use std::ffi::{c_void, CString};
use std::time::Duration;
use tch::{Device, Tensor};

/// Where a rank finds the others: rank 0's store at `host:port`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Rendezvous {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) rank: usize,
    pub(crate) world: usize,
}

/// This process as one rank of a job; leaves it when dropped.
pub(crate) struct Dist {
    kern: &'static Kernels,
    raw: *mut c_void,
    pub(crate) rank: usize,
    pub(crate) world: usize,
}

impl Dist {
    /// Joins the job `at` describes from `device` (a CUDA device: NCCL; the CPU: Gloo), every
    /// collective bounded by `timeout`.
    pub(crate) fn join(
        kern: &'static Kernels,
        at: &Rendezvous,
        device: Device,
        timeout: Duration,
    ) -> Result<Dist> {
        let host = CString::new(at.host.as_str())?;
        let index = match device {
            Device::Cuda(i) => i as i64,
            _ => -1,
        };
        let raw = new_object("joining the data-parallel job", |e, n| unsafe {
            (kern.f.dist_new)(
                host.as_ptr(),
                at.port as i64,
                at.rank as i64,
                at.world as i64,
                index,
                timeout.as_secs_f64(),
                e,
                n,
            )
        })?;
        Ok(Dist {
            kern,
            raw,
            rank: at.rank,
            world: at.world,
        })
    }

    /// Leaves the job at a normal exit, its work done: the backends shut down (NCCL's
    /// communicators destroyed once their work is done) before the membership is freed.
    /// Dropped without it, as after an error, the membership is freed as it stands.
    pub(crate) fn close(self) -> Result<()> {
        status("leaving the data-parallel job", |e, n| unsafe {
            (self.kern.f.dist_close)(self.raw, e, n)
        })
    }

    /// Each of `ts` summed over the ranks, in place.
    pub(crate) fn sum(&self, ts: &[Tensor]) -> Result<()> {
        let p = pointers(ts);
        status("summing over the ranks", |e, n| unsafe {
            (self.kern.f.dist_sum)(self.raw, p.as_ptr(), p.len(), e, n)
        })
    }

    /// Rank 0's values of `ts` on every rank, in place.
    pub(crate) fn broadcast(&self, ts: &[Tensor]) -> Result<()> {
        let p = pointers(ts);
        status("broadcasting rank 0's weights", |e, n| unsafe {
            (self.kern.f.dist_broadcast)(self.raw, p.as_ptr(), p.len(), e, n)
        })
    }

    /// (Re)builds the reducer over `params`, in the order the forward uses them: buckets of
    /// `bucket_bytes`, the first of `first_bytes`.
    pub(crate) fn reducer(
        &self,
        params: &[Tensor],
        first_bytes: usize,
        bucket_bytes: usize,
    ) -> Result<()> {
        let p = pointers(params);
        status("building the gradient reducer", |e, n| unsafe {
            (self.kern.f.dist_reducer)(
                self.raw,
                p.as_ptr(),
                p.len(),
                first_bytes as i64,
                bucket_bytes as i64,
                e,
                n,
            )
        })
    }

    /// Arms the reducer: the next backward's gradients are averaged over the ranks.
    pub(crate) fn arm(&self) -> Result<()> {
        status("arming the gradient reducer", |e, n| unsafe {
            (self.kern.f.dist_arm)(self.raw, e, n)
        })
    }

    /// After the armed backward: every parameter reduced, those it did not reach with zeros;
    /// returns how many it did not reach.
    pub(crate) fn finish(&self) -> Result<usize> {
        let mut unreached = 0i64;
        status("reducing the gradients", |e, n| unsafe {
            (self.kern.f.dist_finish)(self.raw, &mut unreached, e, n)
        })?;
        Ok(unreached as usize)
    }
}

impl Drop for Dist {
    fn drop(&mut self) {
        unsafe { (self.kern.f.dist_free)(self.raw) }
    }
}
