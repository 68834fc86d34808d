//! `strata-envoy`: Strata as an Envoy HTTP filter (proxy-wasm 0.2, `wasm32-wasip1`).
//!
//! The same decisions as the edge: the rules and the request path are `strata-core`'s
//! ([`strata_core::driver`]); [`filter`] maps a VM's callbacks to the driver's events over a
//! [`host::Host`], [`store`] keeps the window keys' states, and the glue below (the ABI's
//! entry points; [`abi`] holds its host calls, with no SDK) only routes Envoy's callbacks to it
//! and applies the decisions once the VM is released. The VMs
//! of an Envoy (one per worker thread) share their window keys' states through shared data
//! ([`shared`]), so the gateway sees one process; what finds no slot goes to the VM's own table.

// A panic kills the VM, and Envoy then hangs or fails requests: no indexing that can fail
// (unwrap, expect and panic are denied workspace-wide).
#![deny(clippy::indexing_slicing)]

pub mod abi;
pub mod config;
pub mod filter;
pub mod host;
pub mod metrics;
pub mod shared;
pub mod store;

#[cfg(target_arch = "wasm32")]
mod glue {
    //! The ABI's entry points, routed to the plugin's [`Vm`]. A root context holds a plugin;
    //! a stream is its context id and costs nothing here (the plugin it belongs to is looked
    //! up only when one VM serves several plugins).
    #![allow(unsafe_code)] // the ABI's exports are `no_mangle`, and `_initialize` runs the constructors

    use std::cell::RefCell;
    use std::collections::BTreeMap;

    use crate::abi::{Buffer, calls};
    use crate::config::Config;
    use crate::filter::{Settle, Verdict, Vm, apply};
    use crate::host::{Envoy, Host};

    /// One plugin (root context) of this VM and, once configured, its state.
    struct Plugin {
        root: u32,
        vm: Option<Vm>,
    }

    #[derive(Default)]
    struct Plugins {
        list: Vec<Plugin>,
        /// Stream → its root context, for the streams made while the VM served more than one
        /// plugin.
        streams: BTreeMap<u32, u32>,
    }

    impl Plugins {
        /// The root context of stream `context`: the one it was made under if more than one
        /// plugin was live then, else the first (the only one then, and still the first:
        /// plugins are appended).
        fn root_of(&self, context: u32) -> Option<u32> {
            match self.streams.get(&context) {
                Some(root) => Some(*root),
                None => self.list.first().map(|p| p.root),
            }
        }

        fn plugin(&mut self, root: u32) -> Option<&mut Plugin> {
            self.list.iter_mut().find(|p| p.root == root)
        }

        fn vm(&mut self, root: u32) -> Option<&mut Vm> {
            self.plugin(root)?.vm.as_mut()
        }
    }

    thread_local! {
        static PLUGINS: RefCell<Plugins> = RefCell::new(Plugins::default());
    }

    /// Runs `f` on the VM of root context `root`, then applies the decisions it made with the
    /// VM released: resuming or answering a stream can call back into the VM at once.
    /// `current` is the context the callback came to.
    fn on_root<T>(root: u32, current: u32, f: impl FnOnce(&mut Vm) -> T) -> Option<T> {
        let (out, settled): (T, Vec<Settle>) = PLUGINS.with(|plugins| {
            let mut plugins = plugins.try_borrow_mut().ok()?;
            let vm = plugins.vm(root)?;
            let out = f(vm);
            Some((out, vm.take_settled()))
        })?;
        apply(&Envoy, settled, current);
        Some(out)
    }

    /// [`on_root`] for a stream's callback.
    fn on_stream<T>(context: u32, f: impl FnOnce(&mut Vm) -> T) -> Option<T> {
        let root = PLUGINS.with(|p| p.try_borrow().ok()?.root_of(context))?;
        on_root(root, context, f)
    }

    #[cfg(target_os = "wasi")]
    unsafe extern "C" {
        fn __wasm_call_ctors();
    }

    /// The reactor's start: static constructors, once, before any other entry point.
    #[unsafe(no_mangle)]
    extern "C" fn _initialize() {
        #[cfg(target_os = "wasi")]
        // SAFETY: the linker's constructor list, called once, as the reactor ABI asks.
        unsafe {
            __wasm_call_ctors();
        }
    }

    #[unsafe(no_mangle)]
    extern "C" fn proxy_abi_version_0_2_1() {}

    #[unsafe(no_mangle)]
    extern "C" fn proxy_on_vm_start(_root: u32, _size: usize) -> u32 {
        1
    }

    #[unsafe(no_mangle)]
    extern "C" fn proxy_on_context_create(context: u32, root: u32) {
        PLUGINS.with(|plugins| {
            let Ok(mut plugins) = plugins.try_borrow_mut() else {
                return;
            };
            if root == 0 {
                plugins.list.push(Plugin {
                    root: context,
                    vm: None,
                });
            } else if plugins.list.len() > 1 {
                plugins.streams.insert(context, root);
            }
        });
    }

    /// A bad configuration makes Envoy refuse it (0), with the reason in its log.
    #[unsafe(no_mangle)]
    extern "C" fn proxy_on_configure(root: u32, size: usize) -> u32 {
        let bytes = calls::buffer(Buffer::PluginConfiguration, size)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = match Config::from_json(&bytes) {
            Ok(config) => config,
            Err(e) => {
                Envoy.log(true, &format!("strata: invalid configuration: {e}"));
                return 0;
            }
        };
        let vm = Vm::new(config, &Envoy);
        let period = u32::try_from(vm.tick_period().as_millis()).unwrap_or(u32::MAX);
        if let Err(e) = calls::set_tick_period(period) {
            Envoy.log(
                true,
                &format!("strata: no tick ({e}): gateway calls cannot time out"),
            );
            return 0;
        }
        PLUGINS.with(|plugins| {
            let Ok(mut plugins) = plugins.try_borrow_mut() else {
                return 0;
            };
            match plugins.plugin(root) {
                Some(plugin) => {
                    plugin.vm = Some(vm);
                    1
                }
                None => 0,
            }
        })
    }

    #[unsafe(no_mangle)]
    extern "C" fn proxy_on_tick(root: u32) {
        on_root(root, root, |vm| vm.on_tick(&Envoy));
    }

    #[unsafe(no_mangle)]
    extern "C" fn proxy_on_queue_ready(root: u32, _queue: u32) {
        on_root(root, root, |vm| vm.on_wake(&Envoy));
    }

    #[unsafe(no_mangle)]
    extern "C" fn proxy_on_http_call_response(
        root: u32,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        on_root(root, root, |vm| {
            vm.on_call_response(&Envoy, token, body_size)
        });
    }

    /// 0: go on; 1: stop (the request waits for a gateway call, or gets a local reply).
    #[unsafe(no_mangle)]
    extern "C" fn proxy_on_request_headers(context: u32, _headers: usize, _end: u32) -> u32 {
        #[cfg(feature = "fault-injection")]
        fault::trap_if_asked();
        match on_stream(context, |vm| vm.on_request(&Envoy, context)) {
            Some(Verdict::Pause) => 1,
            _ => 0,
        }
    }

    #[unsafe(no_mangle)]
    extern "C" fn proxy_on_response_headers(context: u32, _headers: usize, _end: u32) -> u32 {
        on_stream(context, |vm| vm.on_response(&Envoy, context));
        0
    }

    /// A stream is gone (answered, or its client hung up): a call it made still settles the
    /// requests that joined it. A root context going away takes its plugin with it.
    #[unsafe(no_mangle)]
    extern "C" fn proxy_on_delete(context: u32) {
        let root = PLUGINS.with(|plugins| {
            let mut plugins = plugins.try_borrow_mut().ok()?;
            let before = plugins.list.len();
            plugins.list.retain(|p| p.root != context);
            if plugins.list.len() < before {
                return None; // a root context: its plugin went with it
            }
            let root = plugins.root_of(context);
            plugins.streams.remove(&context);
            root
        });
        if let Some(root) = root {
            on_root(root, context, |vm| vm.on_done(context));
        }
    }

    /// A test build's deliberate VM failure (feature `fault-injection`, never in a release).
    #[cfg(feature = "fault-injection")]
    mod fault {
        use crate::abi::{Map, calls};

        pub(super) fn trap_if_asked() {
            let asked = calls::header(Map::RequestHeaders, "x-strata-fault");
            if asked.ok().flatten().as_deref() == Some(b"trap".as_slice()) {
                core::arch::wasm32::unreachable();
            }
        }
    }
}
