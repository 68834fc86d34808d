//! `strata-envoy`: Strata as an Envoy HTTP filter (proxy-wasm 0.2, `wasm32-wasip1`).
//!
//! The same decisions as the edge: the rules and the request path are `strata-core`'s
//! ([`strata_core::driver`]); [`filter`] maps a VM's callbacks to the driver's events over a
//! [`host::Host`], [`store`] keeps the window keys' states, and the proxy-wasm glue below only
//! routes Envoy's callbacks to it and applies the decisions once the VM is released. The VMs
//! of an Envoy (one per worker thread) share their window keys' states through shared data
//! ([`shared`]), so the gateway sees one process; what finds no slot goes to the VM's own table.

// A panic kills the VM, and Envoy then hangs or fails requests: no indexing that can fail
// (unwrap, expect and panic are denied workspace-wide).
#![deny(clippy::indexing_slicing)]

pub mod config;
pub mod filter;
pub mod host;
pub mod metrics;
pub mod shared;
pub mod store;

#[cfg(target_arch = "wasm32")]
mod glue {
    use std::cell::RefCell;
    use std::rc::Rc;

    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType, LogLevel};

    use crate::config::Config;
    use crate::filter::{Settle, Verdict, Vm, apply};
    use crate::host::{Envoy, Host};

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Info);
        proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
            Box::new(Root { context_id, vm: None })
        });
    }}

    type Shared = Rc<RefCell<Vm>>;

    /// Runs `f` on the VM, then applies the decisions it made with the VM released: resuming
    /// or answering a stream can call back into the VM at once. `current` is the context
    /// the callback came to.
    fn run<T>(vm: Option<&Shared>, current: u32, f: impl FnOnce(&mut Vm) -> T) -> Option<T> {
        let (out, settled): (T, Vec<Settle>) = {
            let mut vm = vm?.try_borrow_mut().ok()?;
            let out = f(&mut vm);
            (out, vm.take_settled())
        };
        apply(&Envoy, settled, current);
        Some(out)
    }

    struct Root {
        context_id: u32,
        vm: Option<Shared>,
    }

    impl Context for Root {
        fn on_http_call_response(&mut self, token: u32, _: usize, body_size: usize, _: usize) {
            run(self.vm.as_ref(), self.context_id, |vm| {
                vm.on_call_response(&Envoy, token, body_size);
            });
        }
    }

    impl RootContext for Root {
        fn on_configure(&mut self, _: usize) -> bool {
            let bytes = self.get_plugin_configuration().unwrap_or_default();
            match Config::from_json(&bytes) {
                Ok(config) => {
                    let vm = Vm::new(config, &Envoy);
                    self.set_tick_period(vm.tick_period());
                    self.vm = Some(Rc::new(RefCell::new(vm)));
                    true
                }
                Err(e) => {
                    Envoy.log(true, &format!("strata: invalid configuration: {e}"));
                    false
                }
            }
        }

        fn on_tick(&mut self) {
            run(self.vm.as_ref(), self.context_id, |vm| vm.on_tick(&Envoy));
        }

        fn on_queue_ready(&mut self, _: u32) {
            run(self.vm.as_ref(), self.context_id, |vm| vm.on_wake(&Envoy));
        }

        fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Stream {
                context_id,
                vm: self.vm.clone(),
            }))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Stream {
        context_id: u32,
        vm: Option<Shared>,
    }

    impl Stream {
        fn with<T>(&self, f: impl FnOnce(&mut Vm) -> T) -> Option<T> {
            run(self.vm.as_ref(), self.context_id, f)
        }
    }

    impl Context for Stream {
        fn on_done(&mut self) -> bool {
            let context = self.context_id;
            self.with(|vm| vm.on_done(context));
            true
        }
    }

    impl HttpContext for Stream {
        fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
            #[cfg(feature = "fault-injection")]
            fault::trap_if_asked();
            let context = self.context_id;
            match self.with(|vm| vm.on_request(&Envoy, context)) {
                Some(Verdict::Pause) => Action::Pause,
                _ => Action::Continue,
            }
        }

        fn on_http_response_headers(&mut self, _: usize, _: bool) -> Action {
            let context = self.context_id;
            self.with(|vm| vm.on_response(&Envoy, context));
            Action::Continue
        }
    }

    /// A test build's deliberate VM failure (feature `fault-injection`, never in a release).
    #[cfg(feature = "fault-injection")]
    mod fault {
        use proxy_wasm::hostcalls;
        use proxy_wasm::types::MapType;

        pub(super) fn trap_if_asked() {
            let asked =
                hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, "x-strata-fault");
            if asked.ok().flatten().as_deref() == Some(b"trap".as_slice()) {
                core::arch::wasm32::unreachable();
            }
        }
    }
}
