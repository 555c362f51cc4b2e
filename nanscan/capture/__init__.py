"""Failure capture and replay: bundles, replay to the first non-finite op, eager-vs-compiled
comparison, backend bisection."""
from nanscan.capture.bisect import BackendResult, BisectResult, bisect_backends
from nanscan.capture.bundle import Bundle, BundleError, capture_bundle, load_bundle
from nanscan.capture.compare import Comparison, compare
from nanscan.capture.replay import ReplayResult, replay

__all__ = ["BackendResult", "BisectResult", "Bundle", "BundleError", "Comparison", "ReplayResult", "bisect_backends",
           "capture_bundle", "compare", "load_bundle", "replay"]
