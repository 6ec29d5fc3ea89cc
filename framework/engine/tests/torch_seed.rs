//! The lock around libtorch's process-wide generator, alone in its own test process: any
//! unguarded draw elsewhere in the process would disturb it.

use trainrec_engine::with_torch_seed;

#[test]
fn a_seeded_draw_is_not_disturbed_by_reseeding_in_other_threads() {
    // Many small draws, as a model's init makes: room for another thread to reseed between.
    let draw = || {
        with_torch_seed(7, || {
            (0..300)
                .flat_map(|_| Vec::<f32>::try_from(tch::Tensor::rand([8], tch::kind::FLOAT_CPU)).unwrap())
                .collect::<Vec<_>>()
        })
    };
    let alone = draw();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spam = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut k = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                with_torch_seed(k, || ());
                k += 1;
            }
        })
    };
    for _ in 0..50 {
        assert_eq!(draw(), alone);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    spam.join().unwrap();
}
