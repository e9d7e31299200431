//! A histogram of durations that is cheap to observe from many threads at once.
//!
//! The crate's `Histogram` takes a mutex per observation; every FUSE request observes one,
//! so this one keeps each bucket, and the sum (in nanoseconds), in its own atomic instead:
//! an observation is a binary search over a dozen bounds and two relaxed adds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::exemplar::Exemplar;
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Bounds of FUSE request latencies: a round trip costs 10–20 µs, a request that waits on
/// a stalled remote can take seconds.
pub const REQUEST_BOUNDS: &[f64] = &[
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1,
    0.25, 0.5, 1.0, 2.5, 10.0,
];

/// Bounds of refresh round durations: an idle round over thousands of layers takes
/// milliseconds, a round that hits the scan timeout tens of seconds.
pub const ROUND_BOUNDS: &[f64] = &[
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Debug)]
struct Inner {
    /// Upper bounds in seconds, as exposed.
    bounds: &'static [f64],
    /// The same bounds in nanoseconds, for the comparison on the hot path.
    bound_nanos: Box<[u64]>,
    /// Per bucket (not cumulative); the last one is `+Inf`.
    buckets: Box<[AtomicU64]>,
    sum_nanos: AtomicU64,
}

/// Cheap to clone: clones count into the same buckets.
#[derive(Debug, Clone)]
pub struct Latency(Arc<Inner>);

impl Latency {
    pub fn new(bounds: &'static [f64]) -> Latency {
        Latency(Arc::new(Inner {
            bounds,
            bound_nanos: bounds.iter().map(|b| (b * 1e9).round() as u64).collect(),
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }))
    }

    pub fn requests() -> Latency {
        Latency::new(REQUEST_BOUNDS)
    }

    pub fn observe(&self, elapsed: Duration) {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let inner = &*self.0;
        // `le` buckets: the first bound at or above the value.
        let bucket = inner.bound_nanos.partition_point(|b| *b < nanos);
        if let Some(b) = inner.buckets.get(bucket) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        inner.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.0
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .sum()
    }
}

impl TypedMetric for Latency {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Latency {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let inner = &*self.0;
        let buckets: Vec<(f64, u64)> = inner
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(inner.buckets.iter().map(|b| b.load(Ordering::Relaxed)))
            .collect();
        // The count is the buckets' sum, so that `+Inf` and `_count` agree even while
        // observations land during the scrape.
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = inner.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(
            sum,
            count,
            &buckets,
            None::<&HashMap<usize, Exemplar<NoLabelSet, f64>>>,
        )
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_le_buckets() {
        let h = Latency::new(&[0.001, 0.01]);
        h.observe(Duration::from_micros(1000)); // exactly on a bound: that bucket
        h.observe(Duration::from_micros(5000));
        h.observe(Duration::from_secs(3));
        let counts: Vec<u64> =
            h.0.buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect();
        assert_eq!(counts, [1, 1, 1]);
        assert_eq!(h.count(), 3);
        assert_eq!(h.0.sum_nanos.load(Ordering::Relaxed), 3_006_000_000);
    }
}
