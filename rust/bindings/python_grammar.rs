//! PyO3 bindings for grammars: GrammarCompiler, Grammar, Matcher.
//! Translation only; the logic is in `grammar/matchers.rs`.

use std::collections::HashMap;
use std::sync::Arc;

use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::grammar::matchers::{Grammar, GrammarCompiler, GrammarMatcher, TokenizeFn};

#[pyclass(name = "GrammarCompiler", module = "guided._native", frozen)]
pub struct PyGrammarCompiler {
    inner: Arc<GrammarCompiler>,
}

/// A Python callable `str -> list[int]` as the canonical tokenizer. It runs
/// with the GIL, on whichever thread llguidance calls it from.
fn python_tokenizer(f: Py<PyAny>) -> TokenizeFn {
    Arc::new(move |s: &str| Python::attach(|py| f.bind(py).call1((s,)).and_then(|r| r.extract::<Vec<u32>>()).ok()))
}

#[pymethods]
impl PyGrammarCompiler {
    #[new]
    #[pyo3(signature = (token_bytes, end_token_ids, vocab_size, cache_size = 128, tokenize = None))]
    fn new(
        py: Python<'_>,
        token_bytes: Vec<Vec<u8>>,
        end_token_ids: Vec<u32>,
        vocab_size: usize,
        cache_size: usize,
        tokenize: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let tokenize = tokenize.map(python_tokenizer);
        let inner = py
            .detach(|| GrammarCompiler::new(token_bytes, &end_token_ids, vocab_size, cache_size, tokenize))
            .map_err(PyValueError::new_err)?;
        Ok(PyGrammarCompiler { inner: Arc::new(inner) })
    }

    fn compile(&self, py: Python<'_>, grammar_json: &str) -> PyResult<PyGrammar> {
        let inner = &self.inner;
        let g = py.detach(|| inner.compile(grammar_json)).map_err(PyValueError::new_err)?;
        Ok(PyGrammar { inner: g })
    }

    fn cache_stats(&self) -> HashMap<&'static str, usize> {
        let s = self.inner.cache_stats();
        HashMap::from([("hits", s.hits), ("misses", s.misses), ("size", s.size), ("capacity", s.capacity)])
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
}

#[pyclass(name = "Grammar", module = "guided._native", frozen)]
pub struct PyGrammar {
    pub inner: Grammar,
}

#[pymethods]
impl PyGrammar {
    fn matcher(&self) -> PyMatcher {
        PyMatcher { inner: self.inner.matcher() }
    }
}

#[pyclass(name = "Matcher", module = "guided._native")]
pub struct PyMatcher {
    inner: GrammarMatcher,
}

#[pymethods]
impl PyMatcher {
    fn compute_mask<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        let inner = &mut self.inner;
        let (mask, _err) = py.detach(|| inner.compute_mask());
        mask.into_pyarray(py)
    }

    fn consume_token(&mut self, token: u32) -> bool {
        self.inner.consume(token).is_ok()
    }

    fn consume_tokens(&mut self, tokens: Vec<u32>) -> bool {
        tokens.iter().all(|&t| self.inner.consume(t).is_ok())
    }

    fn forced_tokens(&mut self) -> Vec<u32> {
        self.inner.forced_tokens()
    }

    fn is_accepting(&mut self) -> bool {
        self.inner.is_accepting()
    }

    fn is_stopped(&self) -> bool {
        self.inner.is_stopped()
    }

    fn error(&self) -> Option<String> {
        self.inner.error()
    }

    fn rollback(&mut self, n: usize) -> PyResult<()> {
        self.inner.rollback(n).map_err(PyValueError::new_err)
    }

    /// The shortest completion found that the grammar accepts, as tokens
    /// (at most `max_tokens`), or None.
    #[pyo3(signature = (max_tokens = 4096))]
    fn shortest_completion(&self, py: Python<'_>, max_tokens: usize) -> Option<Vec<u32>> {
        let inner = &self.inner;
        py.detach(|| crate::grammar::closing::shortest_completion(inner, max_tokens)).map(|c| c.tokens)
    }
}
