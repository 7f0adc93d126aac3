"""Figures that do not mislead: log axes read as plain numbers, colour-bar labels inside the picture."""


def test_log_axes_read_as_plain_numbers():
    from h2o_mini.views.plot import figure, plain_log_axis
    plt, fig, (ax,) = figure(1, (4, 3))
    ax.plot([0.05, 0.1, 0.2], [21.0, 35.0, 48.0])
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain_log_axis(ax.xaxis, [0.05, 0.1, 0.2])
    plain_log_axis(ax.yaxis)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
    plt.close(fig)
    assert {"0.05", "0.1", "0.2", "30", "40"} <= set(labels)
    assert not [x for x in labels if "times" in x or "^" in x or "\\" in x]


def test_the_needle_colour_bar_labels_fit_in_the_picture(tmp_path):
    from h2o_mini.views.plot import heatmap_figure
    plt, fig = heatmap_figure({"h2o 0.2 (dense)": {(0.1, 1024): 1.0, (0.9, 1024): 0.0}}, "a title")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bar = fig.axes[-1]
    labels = [t for t in bar.get_yticklabels() if t.get_text()]
    right = max(t.get_window_extent(renderer).x1 for t in labels)
    width = fig.bbox.width
    plt.close(fig)
    assert {"0%", "100%"} <= {t.get_text() for t in labels} and right <= width
